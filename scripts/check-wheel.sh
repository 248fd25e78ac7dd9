#!/usr/bin/env bash
# Build the wheel and install it into a fresh virtual environment (no editable
# install, no system site-packages): the package data (shaders, kernels, sample)
# must be inside it, the console script must work, and the conformance suite
# must pass from the installed wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
$PY -m pip wheel -q --no-deps -w "$work/dist" . 2>&1 | grep -v -i warn || true
# the wheel holds the flare package only: the plugin-author examples in examples/ are
# separate distributions (tests/test_examples.py builds them)
$PY -c "import glob, sys, zipfile; names = zipfile.ZipFile(glob.glob(sys.argv[1])[0]).namelist(); \
stray = [n for n in names if not n.startswith(('flare/', 'flare_runtime-'))]; assert not stray, stray" \
    "$work/dist/flare_runtime-*.whl"
$PY -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q "$work"/dist/flare_runtime-*.whl "pytest>=8" "hypothesis>=6.100" "vulkan>=1.3.275"
cd "$work"   # away from the source tree, so only the wheel can be imported
"$work/venv/bin/flare" backends
"$work/venv/bin/python" -c "import flare.core, pathlib; p = pathlib.Path(flare.core.__file__).parent; print('installed at', p); assert 'site-packages' in str(p)"
"$work/venv/bin/python" -m pytest -q -p no:cacheprovider --pyargs flare.plugins.testing.conformance --backends=cpu --require-backends
# `flare new` writes its skeletons from templates that must be inside the wheel
"$work/venv/bin/flare" new backend wheelcheck -o "$work" >/dev/null
test -f "$work/flare-backend-wheelcheck/src/flare_wheelcheck/device.py"
echo "wheel check passed"
