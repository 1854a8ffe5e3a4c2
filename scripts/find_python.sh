#!/usr/bin/env bash
# Prints the path of a Python >= 3.12 on this machine, or fails. The default python3
# here is 3.11; 3.12 comes from pyenv, whose shims only answer with PYENV_VERSION set.
ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; }
for p in python3 python3.13 python3.12; do
  if command -v "$p" >/dev/null && ok "$p"; then command -v "$p"; exit 0; fi
done
root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
for p in "$root"/versions/3.1[2-9]*/bin/python3; do
  if [ -x "$p" ] && ok "$p"; then echo "$p"; exit 0; fi
done
echo "no Python >= 3.12 found (install one, e.g. 'pyenv install 3.12')" >&2
exit 1
