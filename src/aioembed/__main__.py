"""``python -m aioembed``: the ``aioembed`` command (``demo``, ``bench``)."""

from aioembed.cli import main

if __name__ == "__main__":
    main()
