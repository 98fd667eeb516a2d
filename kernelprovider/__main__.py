"""``python -m kernelprovider install-kernelspecs --hub-url URL``: kernelspecs for the hub's GPU sizes."""

from __future__ import annotations

import argparse
import os
import sys

from .kernelspecs import SPEC_PREFIX, KernelspecError, fetch_sizes, install


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kernelprovider", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    p = sub.add_parser(
        "install-kernelspecs",
        help="install one kernelspec per GPU kernel size the hub offers",
        description="Ask the hub's GPU broker for its kernel sizes and install a kernelspec for each, "
        "e.g. 'Python 3 (GPU 10 GiB)'.",
    )
    p.add_argument(
        "--hub-url",
        default=os.environ.get("JUPYTERHUB_API_URL", ""),
        help="the hub's URL or API URL (default: $JUPYTERHUB_API_URL)",
    )
    p.add_argument("--token", default="", help="API token (default: $JUPYTERHUB_API_TOKEN)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="install in the user's kernelspec directory")
    where.add_argument("--sys-prefix", action="store_true", help="install in this Python's prefix (sys.prefix)")
    where.add_argument("--prefix", default=None, help="install under PREFIX/share/jupyter/kernels")
    p.add_argument("--display-prefix", default="Python 3", help="start of the display names (default: 'Python 3')")
    p.add_argument("--python", default="python", help="python shown in the kernelspecs' argv (default: python)")
    p.add_argument("--name-prefix", default=SPEC_PREFIX, help=f"kernelspec name prefix (default: {SPEC_PREFIX})")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    token = args.token or os.environ.get("JUPYTERHUB_API_TOKEN", "")
    if not args.hub_url:
        print("error: give --hub-url (or run inside a hub server, where JUPYTERHUB_API_URL is set)", file=sys.stderr)
        return 2
    if not token:
        print("error: give --token (or set JUPYTERHUB_API_TOKEN)", file=sys.stderr)
        return 2
    prefix = sys.prefix if args.sys_prefix else args.prefix
    try:
        sizes = fetch_sizes(args.hub_url, token)
        if not sizes:
            print("The hub offers no GPU kernel sizes to this token's owner; nothing installed.")
            return 0
        paths = install(
            sizes,
            user=args.user,
            prefix=prefix,
            prefix_name=args.name_prefix,
            language_display=args.display_prefix,
            python=args.python,
        )
    except KernelspecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for size, path in zip(sizes, paths, strict=True):
        print(f"installed {os.path.basename(path)}: {args.display_prefix} ({size.get('display_name') or size['name']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
