#!/usr/bin/env bash
# Build (once, then reuse) the virtual environment that runs the real SGLang server on CPU.
#
#   tests/support/sglang_env.sh            # prints the venv's python on its last line
#   TETHER_SGLANG_VENV=DIR tests/support/sglang_env.sh
#
# Location: ${TETHER_SGLANG_VENV:-$HOME/.cache/tether/sglang-venv}. The venv is kept apart from
# tether's own (.venv, torch 2.13 CPU) because SGLang 0.5.23 pins torch 2.14.1 and imports
# torchvision, which only loads beside a matching torch (2.14.1 + 0.29.1 lie on this machine's
# disk). SGLang itself goes in with --no-deps: its requirements pull CUDA-only kernels
# (sglang-kernel, flashinfer, ...) that do not install or import on CPU. The packages below are
# what its server imports on the CPU path, every version pinned (a `pip freeze` of a venv that
# served /generate). A stand-in `sgl_kernel` (tests/support/sgl_kernel_standin) supplies the two CPU
# kernels SGLang imports unconditionally.
#
# Idempotent and fast when cached: a stamp (hash of this script and the stand-in) is written
# last; a venv whose stamp matches is reused as is, anything else is removed and rebuilt.
# Concurrent callers serialise on a lock file.
set -euo pipefail

SGLANG_VERSION=0.5.23
SGLANG_ROUTER_VERSION=0.3.2
BASE_PYTHON=${TETHER_SGLANG_BASE_PYTHON:-python3.11}
VENV=${TETHER_SGLANG_VENV:-$HOME/.cache/tether/sglang-venv}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
STANDIN=$HERE/sgl_kernel_standin/sgl_kernel

# The lean import set of SGLang's CPU server path, plus the router. Versions come from PINS.
TOP_LEVEL=(
  torch torchvision
  aiohttp fastapi uvicorn uvloop orjson pybase64 python-multipart pydantic requests
  transformers tokenizers sentencepiece tiktoken safetensors huggingface_hub
  xgrammar llguidance interegular partial-json-parser jsonschema
  compressed-tensors gguf einops numpy scipy pillow soundfile
  pyzmq msgspec setproctitle psutil torch_memory_saver prometheus_client watchfiles
  ipython dill distro tqdm regex packaging python-dateutil blobfile openai openai-harmony
  xxhash zstandard
)

PINS=$(cat <<'PINS_END'
aiohappyeyeballs==2.7.1
aiohttp==3.14.5
aiosignal==1.4.0
annotated-doc==0.0.7
annotated-types==0.8.0
anyio==4.16.0
apache-tvm-ffi==0.1.15.post2
asttokens==3.0.2
attrs==26.1.0
blobfile==3.0.0
certifi==2026.10.19.post1
cffi==2.1.1
charset-normalizer==3.5.3
click==8.5.1
compressed-tensors==0.18.0
cuda-bindings==13.5.0
cuda-pathfinder==1.9.1
cuda-toolkit==13.0.3.0
dill==0.4.1
distro==1.9.0
einops==0.8.2
executing==2.3.0
fastapi==0.165.0
filelock==4.3.1
frozenlist==1.8.0
fsspec==2026.9.0
gguf==0.19.0
h11==0.16.0
hf-xet==1.8.0
httpcore==1.0.9
httpx==0.28.1
huggingface_hub==1.33.0
idna==3.20
interegular==0.3.3
ipython==9.18.1
ipython_pygments_lexers==1.1.1
jedi==0.20.1
Jinja2==3.1.6
jiter==0.19.0
jsonschema==4.26.0
jsonschema-specifications==2025.9.1
llguidance==1.9.1
loguru==0.7.3
lxml==6.1.3
markdown-it-py==4.3.0
MarkupSafe==3.0.4
matplotlib-inline==0.2.2
mdurl==0.1.2
mpmath==1.3.0
msgspec==0.23.0
multidict==7.2.1
networkx==3.6.1
numpy==2.4.6
nvidia-cublas==13.1.1.3
nvidia-cuda-cupti==13.0.85
nvidia-cuda-nvrtc==13.0.88
nvidia-cuda-runtime==13.0.96
nvidia-cudnn-cu13==9.24.0.43
nvidia-cufft==12.0.0.61
nvidia-cufile==1.15.1.6
nvidia-curand==10.4.0.35
nvidia-cusolver==12.0.4.66
nvidia-cusparse==12.6.3.3
nvidia-cusparselt-cu13==0.8.1
nvidia-nccl-cu13==2.30.7
nvidia-nvjitlink==13.5.37
nvidia-nvshmem-cu13==3.4.5
nvidia-nvtx==13.0.85
openai==2.8.0
openai-harmony==0.0.4
opentelemetry-api==1.45.2
orjson==3.13.0
packaging==26.4
parso==0.8.7
partial-json-parser==0.2.1.1.post7
pexpect==4.9.0
pillow==13.0.0
prometheus_client==0.26.0
prompt_toolkit==3.0.53
propcache==0.5.4
psutil==7.2.2
ptyprocess==0.7.0
pure_eval==0.2.4
pybase64==1.5.1
pycparser==3.12
pycryptodomex==3.24.2
pydantic==2.14.4
pydantic_core==2.50.5
Pygments==2.21.0
python-dateutil==2.9.0.post0
python-multipart==0.0.34
PyYAML==6.0.4
pyzmq==27.3.0
referencing==0.37.0
regex==2026.11.19
requests==2.34.2
rich==15.0.0
rpds-py==2026.9.1
safetensors==0.8.0
scipy==1.17.1
sentencepiece==0.2.1
setproctitle==1.3.8
shellingham==1.5.4
six==1.17.0
sniffio==1.3.1
soundfile==0.13.1
stack-data==0.6.3
starlette==1.10.0
sympy==1.14.0
tiktoken==0.14.0
tokenizers==0.23.2
torch==2.14.1
torch_memory_saver==0.0.10
torchvision==0.29.1
tqdm==4.70.1
traitlets==5.16.1
transformers==5.19.0
triton==3.8.0
typer==0.29.2
typing-inspection==0.4.5
typing_extensions==4.16.0
urllib3==2.8.0
uvicorn==0.54.0
uvloop==0.23.0
watchfiles==1.3.0
wcwidth==0.9.4
xgrammar==0.2.7
xxhash==4.1.0
yarl==1.25.1
zstandard==0.25.0
PINS_END
)

stamp() {
  { cat "${BASH_SOURCE[0]}"; cat "$STANDIN/__init__.py"; } | sha256sum | cut -c1-16
}

main() {
  local want have python
  want=$(stamp)
  python=$VENV/bin/python
  mkdir -p "$(dirname "$VENV")"
  exec 9>"$VENV.lock"
  flock 9
  have=$(cat "$VENV/.tether-stamp" 2>/dev/null || true)
  if [[ "$have" == "$want" && -x "$python" ]]; then
    echo "sglang venv up to date: $VENV" >&2
    echo "$python"
    return 0
  fi
  local start=$SECONDS
  echo "building the sglang venv in $VENV (stamp ${have:-none} -> $want)" >&2
  rm -rf "$VENV"
  "$BASE_PYTHON" -m venv "$VENV"
  local pins_file=$VENV/tether-pins.txt
  printf '%s\n' "$PINS" >"$pins_file"
  local pip=("$python" -m pip --disable-pip-version-check --quiet)
  # torch first, on its own: it must resolve to the on-disk 2.14.1 build and its CUDA wheels.
  "${pip[@]}" install -c "$pins_file" torch torchvision
  "${pip[@]}" install -c "$pins_file" "${TOP_LEVEL[@]}"
  # --no-deps: SGLang's and the router's requirements name CUDA-only packages.
  "${pip[@]}" install --no-deps "sglang==$SGLANG_VERSION" "sglang-router==$SGLANG_ROUTER_VERSION"
  local site
  site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  rm -rf "$site/sgl_kernel"
  cp -r "$STANDIN" "$site/sgl_kernel"
  # Fail the build, not a later test, when the server's imports are incomplete.
  SGLANG_USE_CPU_ENGINE=1 "$python" -c 'import sglang.launch_server, sglang_router.launch_router, sgl_kernel'
  echo "$want" >"$VENV/.tether-stamp.tmp"
  sync "$VENV/.tether-stamp.tmp"
  mv "$VENV/.tether-stamp.tmp" "$VENV/.tether-stamp"
  echo "sglang venv built in $((SECONDS - start)) s ($(du -sh "$VENV" | cut -f1))" >&2
  echo "$python"
}

main "$@"
