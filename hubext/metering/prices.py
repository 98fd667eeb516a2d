"""Prices per GPU model: validated once, then applied to usage records (pure).

Configured as ``c.UsageMeter.prices`` (a dict by pool model name, ``"*"`` for every other
model) and ``c.UsageMeter.currency``, or ``c.UsageMeter.prices_file``: the Helm chart's
``metering`` values (``currency``, ``prices``) as JSON (:func:`load_prices_file`). Each
model's entry is a mapping with any of:

``gpu_hour``
    the price of one whole card for one hour;
``memory_gib_hour``
    the price of one GiB of GPU memory for one hour (a slice's memory share);
``compute_hour``
    the price of 100 % of a card's compute for one hour (a slice's compute share).

A slice costs ``memory GiB x memory_gib_hour + cores/100 x compute_hour`` per GPU-hour when
the split prices are given, else its card share (the larger of its memory and compute share)
x ``gpu_hour``. A whole card costs ``gpu_hour`` (or, when only split prices are given, its
whole memory and compute at those prices).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from quotas import ConfigError

from .record import UsageRecord

PRICE_KEYS = ("gpu_hour", "memory_gib_hour", "compute_hour")


@dataclass(frozen=True)
class ModelPrice:
    gpu_hour: float | None = None
    memory_gib_hour: float | None = None
    compute_hour: float | None = None

    @property
    def split(self) -> bool:
        return self.memory_gib_hour is not None or self.compute_hour is not None

    def per_gpu_hour(self, record: UsageRecord) -> float:
        """What one of the record's GPUs costs for one hour."""
        memory_gib_hour = self.memory_gib_hour or 0.0
        compute_hour = self.compute_hour or 0.0
        if record.whole:
            if self.gpu_hour is not None:
                return self.gpu_hour
            return record.gpu_memory_mib / 1024 * memory_gib_hour + compute_hour
        if self.split:
            return record.memory_mib / 1024 * memory_gib_hour + record.cores_percent / 100 * compute_hour
        return record.share * (self.gpu_hour or 0.0)


@dataclass(frozen=True)
class PriceTable:
    """Prices by model (``"*"``: every other model) in ``currency``; empty: nothing is priced."""

    models: Mapping[str, ModelPrice]
    currency: str = "USD"

    def price_of(self, model: str) -> ModelPrice | None:
        return self.models.get(model) or self.models.get("*")

    def cost(self, record: UsageRecord, hours: float) -> float | None:
        """The cost of ``hours`` of ``record`` (all its GPUs); None when its model has no price."""
        price = self.price_of(record.gpu_model)
        if price is None:
            return None
        return hours * record.count * price.per_gpu_hour(record)


def load_prices(prices: Mapping[str, Any] | None, currency: str = "USD", *, trait: str = "UsageMeter") -> PriceTable:
    """Validate ``prices`` (see the module docstring); raise ConfigError naming the bad key."""
    if not isinstance(currency, str) or not currency.strip():
        raise ConfigError(f"{trait}.currency must be a currency name such as 'USD' or 'EUR'; got {currency!r}.")
    if prices is None:
        prices = {}
    if not isinstance(prices, Mapping):
        raise ConfigError(
            f"{trait}.prices must be a mapping of GPU model to prices, such as "
            f"{{'H100-80GB': {{'gpu_hour': 2.5}}}}; got {type(prices).__name__}."
        )
    models: dict[str, ModelPrice] = {}
    for model, entry in prices.items():
        where = f"{trait}.prices[{model!r}]"
        if not isinstance(model, str) or not model:
            raise ConfigError(f"{trait}.prices: a GPU model name must be a non-empty string; got {model!r}.")
        if not isinstance(entry, Mapping):
            raise ConfigError(
                f"{where} must be a mapping with any of {', '.join(PRICE_KEYS)} "
                f"(prices per hour in {currency}); got {entry!r}."
            )
        unknown = sorted(set(entry) - set(PRICE_KEYS))
        if unknown:
            raise ConfigError(
                f"{where}: unknown key {unknown[0]!r}; the keys are {', '.join(PRICE_KEYS)} (prices per hour)."
            )
        if not entry:
            raise ConfigError(f"{where} is empty; give at least gpu_hour, or memory_gib_hour and compute_hour.")
        values: dict[str, float] = {}
        for key, value in entry.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"{where}.{key} must be a number of {currency} per hour, 0 or more; got {value!r}.")
            values[key] = float(value)
        models[model] = ModelPrice(**values)
    return PriceTable(models=models, currency=currency.strip())


def load_prices_file(path: str) -> PriceTable:
    """The prices of a JSON file ``{"currency": ..., "prices": {...}}`` (the Helm chart's
    ``metering`` values, rendered into its ConfigMap); ConfigError naming the file and the key."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read the GPU prices file {path}: {e.strerror}.") from None
    except ValueError as e:
        raise ConfigError(f"the GPU prices file {path} is not valid JSON: {e}.") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"the GPU prices file {path} must hold a mapping with currency and prices.")
    unknown = sorted(set(data) - {"currency", "prices"})
    if unknown:
        raise ConfigError(f"{path}: metering: unknown key {unknown[0]!r}; the keys are currency and prices.")
    try:
        return load_prices(data.get("prices"), data.get("currency", "USD"), trait="metering")
    except ConfigError as e:
        raise ConfigError(f"{path}: {e.message}") from None
