"""Make the running virtual environment read a base one's packages after its own.

    .venv-sm90/bin/python scripts/layer_venv.py .venv

Writes a .pth file into this environment's site-packages that adds the base's
site-packages as a site directory, so the base's own .pth files (the project's editable
install) are read too. Packages installed here come first on sys.path, so the layer
adds to the base (JAX's CUDA plugin) without a second copy of what the base holds.
"""

import sys
import sysconfig
from pathlib import Path

PTH_NAME = "_base_venv.pth"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(f"usage: {Path(sys.argv[0]).name} BASE_VENV", file=sys.stderr)
        return 2
    base = Path(argv[0]).resolve()
    base_python = base / "bin" / "python"
    if not base_python.exists():
        print(f"{base} is not a virtual environment (no bin/python)", file=sys.stderr)
        return 2
    if base == Path(sys.prefix).resolve():
        print("BASE_VENV is this environment", file=sys.stderr)
        return 2
    here = Path(sysconfig.get_path("purelib"))
    # The base's purelib under its own prefix: the same Python version as this one,
    # which the Makefile guarantees by making both from $(PYTHON).
    base_site = Path(sysconfig.get_path("purelib", vars={"base": str(base)}))
    if not base_site.is_dir():
        print(f"no site-packages at {base_site}", file=sys.stderr)
        return 2
    (here / PTH_NAME).write_text(f"import site; site.addsitedir({str(base_site)!r})\n")
    print(f"{here / PTH_NAME}: reads {base_site}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
