#!/usr/bin/env bash
# Make the virtual environment in which bench/loader.py --loaders measures MosaicML
# streaming, apart from the project's own: streaming requires numpy<2.2 and
# transformers<5 (see streaming-requirements.txt beside this script). It ends by
# writing a small MDS dataset and reading it back (streaming_mds.py check).
#
#   bash bench/peers/streaming-venv.sh [DIR]
#
# DIR is ${XDG_CACHE_HOME:-~/.cache}/fastst-bench/streaming-venv unless given, where
# bench/loader.py looks for it: outside the repository, whose tests read every .py
# and .md file under it. PYTHON names the interpreter (python3.11 by default: the CPU
# torch wheel pinned is built for it). The environment is made anew each time.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
target="${1:-${XDG_CACHE_HOME:-$HOME/.cache}/fastst-bench/streaming-venv}"
python="${PYTHON:-python3.11}"

if [ -e "$target" ]; then
    [ -f "$target/pyvenv.cfg" ] || { echo "$target exists and is no virtual environment" >&2; exit 1; }
    rm -rf "$target"
fi
mkdir -p "$(dirname "$target")"
"$python" -m venv "$target"
"$target/bin/python" -m pip install --quiet -r "$here/streaming-requirements.txt"
# --no-deps: its requirements bring torchvision (see streaming-requirements.txt)
"$target/bin/python" -m pip install --quiet --no-deps mosaicml-streaming==0.13.0
"$target/bin/python" - <<'PY'
import numpy, torch
assert not torch.version.cuda, f"a CUDA build of torch was installed: {torch.__version__}"
from importlib.metadata import version
print(f"mosaicml-streaming {version('mosaicml-streaming')}, numpy {numpy.__version__}, "
      f"torch {torch.__version__}, transformers {version('transformers')}")
PY
"$target/bin/python" "$here/streaming_mds.py" check
