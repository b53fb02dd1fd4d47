#!/usr/bin/env bash
# The released FlexPrefill and XAttention files that `profiling/peers.py --official DIR` imports, into DIR
# (default: official/, ignored by git; never commit it). Reads the repositories from a local mirror when there is one
# ($MIRROR/<owner>+<name>/repo, a git directory, as the workplace's fetch tool leaves them), else clones them.
#
#   profiling/fetch_peers.sh official
#   DIR/FlexPrefill/flex_prefill/ops/flex_prefill_attention.py   selection + Triton kernel (needs triton, einops)
#   DIR/x-attention/xattn/{__init__.py,src/Xattention.py,src/utils.py,src/kernels.py}   estimate (+ Triton kernels)
#
# Nothing else is needed: peers.py imports FlexPrefill's op file by path (the package's __init__ patches
# transformers 4.44 models) and stubs `block_sparse_attn` (XAttention's CUDA kernel, not on the registry) when it is
# absent, so XAttention's estimate runs and its kernel time is left out. The folder is a few hundred KB: carry it
# to the GPU with the run tool (carry: ["official"]).
set -euo pipefail
dest=${1:-official}
mirror=${MIRROR:-/work/.mirror}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$dest"
: > "$dest/SOURCES"

get() {  # owner/name, then the paths to extract
    local repo=$1 name=${1#*/} git_dir
    shift
    git_dir="$mirror/${repo/\//+}/repo"
    if [ ! -d "$git_dir" ]; then
        git_dir="$scratch/$name.git"
        git clone --quiet --bare --depth 1 "https://github.com/$repo" "$git_dir"
    fi
    for path in "$@"; do        # file by file: a mirror may lack large unrelated blobs that `git archive` would read
        mkdir -p "$(dirname "$dest/$name/$path")"
        git --git-dir="$git_dir" show "HEAD:$path" > "$dest/$name/$path"
    done
    echo "$repo $(git --git-dir="$git_dir" rev-parse HEAD)" >> "$dest/SOURCES"
}

get ByteDance-Seed/FlexPrefill LICENSE flex_prefill/ops/flex_prefill_attention.py
get mit-han-lab/x-attention xattn/__init__.py xattn/src/Xattention.py xattn/src/utils.py xattn/src/kernels.py
cat "$dest/SOURCES"
