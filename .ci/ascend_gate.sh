#!/usr/bin/env bash
# Ascend gate (docs/ascend-gate.md): every Triton kernel must lower with triton-ascend and get a unified-buffer
# plan from BiSheng (ascendnpu-ir's bishengir-compile), and the gate must fail the known-bad kernels of
# tests/ascend. triton-ascend ships its own top-level `triton`, so it gets a virtual environment of its own,
# reused while its pins hold (BiSheng's results are cached in it, per module and options).
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${ASCEND_VENV:-.venv-ascend}"
python="${ASCEND_PYTHON:-python3}"  # triton-ascend 3.2.0 has wheels for Python 3.10 and 3.11 only
# torch only because the op modules import it; pinned, since an unpinned torch pulls a multi-GB CUDA build.
# ascendnpu-ir installs only its own `ascendnpuir` package (bishengir-compile, no hivmc), nothing of triton-ascend's.
pins=(triton-ascend==3.2.0 ascendnpu-ir==1.2.0 torch==2.13.0 pybind11 numpy)

venv_ok() {
    "$venv/bin/python" - 2>/dev/null <<'EOF'
import importlib.metadata as md, sys
def version(dist):
    try:
        return md.version(dist).split("+")[0]
    except md.PackageNotFoundError:
        return None
# Upstream triton (a dependency of CUDA torch builds) would overwrite triton-ascend's `triton`.
ok = version("triton-ascend") == "3.2.0" and version("torch") == "2.13.0" and version("triton") is None
ok = ok and version("ascendnpu-ir") == "1.2.0"
sys.exit(0 if ok and version("pybind11") and version("numpy") else 1)
EOF
}

if ! venv_ok; then
    echo "ascend gate: creating $venv"
    "$python" -m venv --clear "$venv"
    "$venv/bin/python" -m pip install --quiet "${pins[@]}"
    venv_ok || { echo "ascend gate: $venv lacks ${pins[*]} or holds upstream triton" >&2; exit 1; }
fi

targets="${ASCEND_TARGETS:-a2,a3}"  # add 950 for the Ascend 950 adapter variant (doubles the time)
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
echo "ascend gate: lowering every kernel of triton_kernels for $targets, and through BiSheng for A2/A3"
"$venv/bin/python" -m ascend_gate --targets "$targets" | tee "$log"
echo "ascend gate: the gate must fail tests/ascend/bad_kernels.py"
"$venv/bin/python" tests/ascend/check_negative.py
# check_negative.py has passed, so BiSheng failed its kernel whose tile cannot fit the UB.
echo "ascend gate: BiSheng: $(sed -n 's/^bisheng: //p' "$log"), negative UB kernel caught"
