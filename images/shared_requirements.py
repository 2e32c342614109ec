"""Print the requirements pinned identically (version and hashes) in every lock named on the command line.

The cpu and serve Dockerfiles install these first, in a step whose instruction and inputs are the same in both, so
the two images share that layer (torch, transformers, kfp, ... most of their size) and a build of one reuses it
from the other's layer cache; each image's own lock then adds the rest. Runs on the base image's Python alone.
"""

import sys


def entries(path: str) -> dict[str, str]:
    """``{"name==version": "name==version --hash=... --hash=..."}`` of a ``pip-compile --generate-hashes`` lock."""
    found: dict[str, str] = {}
    current: list[str] = []
    with open(path, encoding="utf-8") as lock:
        for raw in lock:
            line = raw.split("#", 1)[0].strip().rstrip("\\").strip()
            if not line:
                continue
            if raw[0].isspace() and current:
                current.append(line)
                continue
            current = [line]
            found[line] = current
    return {key: " ".join(parts) for key, parts in found.items()}


def main(paths: list[str]) -> None:
    locks = [entries(path) for path in paths]
    for key in sorted(locks[0]):
        if all(lock.get(key) == locks[0][key] for lock in locks[1:]):
            print(locks[0][key])


if __name__ == "__main__":
    main(sys.argv[1:])
