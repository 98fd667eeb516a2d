"""Tests of the admission core (quotas/)."""
