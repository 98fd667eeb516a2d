"""``python -m culler``: run the GPU culler service."""

from .app import main

if __name__ == "__main__":
    main()
