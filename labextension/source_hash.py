"""The hash of the JupyterLab extension's source, recorded beside the build made from it.

``./dev lab-build`` builds ``labextension/`` into ``kernelprovider/labextension/`` (committed, so
installing the package needs no Node.js) and runs ``python labextension/source_hash.py --write``;
``tests/lab/test_build.py`` checks that the committed build was made from the committed source.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUILD = HERE.parent / "kernelprovider" / "labextension"
RECORD = BUILD / "source.sha256"


def source_files() -> list[Path]:
    """What the build is made from: the package metadata, the scripts and the styles."""
    return [HERE / "package.json", *sorted((HERE / "src").glob("*.js")), *sorted((HERE / "style").glob("*.css"))]


def source_hash() -> str:
    digest = hashlib.sha256()
    for path in source_files():
        digest.update(path.relative_to(HERE).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        RECORD.write_text(source_hash() + "\n")
        return 0
    recorded = RECORD.read_text().strip() if RECORD.exists() else ""
    if recorded != source_hash():
        print("kernelprovider/labextension/ was not built from labextension/ as it is: run ./dev lab-build")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
