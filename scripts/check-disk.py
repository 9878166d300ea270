"""Stop with one line when the disk holding the current directory has too little free space.

    python scripts/check-disk.py GIB WHAT

GIB: the free space needed, in GiB (0 or less: always passes). WHAT: what needs it, for the message.
``make compat`` runs it before installing a torch of several GiB.
"""

import shutil
import sys


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python scripts/check-disk.py GIB WHAT", file=sys.stderr)
        return 2
    try:
        need = float(argv[1])
    except ValueError:
        print(f"check-disk: GIB={argv[1]!r} is not a number; pass the GiB needed, e.g. 7", file=sys.stderr)
        return 2
    free = shutil.disk_usage(".").free / 2**30
    if free >= need:
        return 0
    print(
        f"check-disk: {argv[2]} needs about {need:g} GiB and {free:.1f} GiB are free here; free some "
        f"(old pytest runs: rm -rf /tmp/pytest-of-$USER) or pass COMPAT_DISK_GIB=0 to try anyway",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
