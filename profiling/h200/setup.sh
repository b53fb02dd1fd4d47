# Source at the start of every call on the H200 device machine (run from the repository root there):
#   source profiling/h200/setup.sh > /tmp/setup.log 2>&1
# directly, not through a pipe (`source ... | tail` runs it in a subshell: its PYTHONPATH is lost, and with it
# flash-attn-4). The machine goes back ~30 s after a call ends, with /tmp and a background queue: while a queue
# runs, make the next call at once.
# It takes what the call carried into /tmp, which the machine keeps while it stays warm (~30 s between calls):
#   .fa4a, .fa4b  flash-attn-4 wheels (../shared/tools/fa4-wheels.sh, rebalanced into two carries under 64 MiB)
#   .whl          other wheels (gguf, needlehaystack)
#   .q50          chunks of the Qwen2.5-Coder GGUFs, one a call (split -b 58806360 -d -a 2 FILE .q50/NAME.: 19 for the 1.5B,
#                 which leaves the ~7 MB working tree room under the 64 MiB a call carries)
# joins a model once its chunks hold all its bytes (checking its sha256), and exports PYTHONPATH.
mkdir -p /tmp/fa4w /tmp/m /tmp/site /tmp/site2
if [ -d .fa4a ]; then cp .fa4a/* /tmp/fa4w/; fi
if [ -d .fa4b ]; then cp .fa4b/* /tmp/fa4w/ && bash /tmp/fa4w/install.sh; fi
if [ -d .whl ]; then   # its own folder: the flash-attn-4 install into /tmp/site can replace what is there
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site2 .whl/*.whl
fi
if [ -d .q50 ]; then cp .q50/* /tmp/m/; fi
for spec in qwen2.5-coder-0.5b:491400064:1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 \
            qwen2.5-coder-1.5b:1117320768:cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046; do
  IFS=: read -r name bytes sha <<<"$spec"
  [ ! -s "/tmp/m/$name.gguf" ] && [ -e "/tmp/m/$name.00" ] || continue
  held=$(stat -c %s /tmp/m/"$name".[0-9][0-9] | awk '{ s += $1 } END { print s }')
  if [ "$held" -eq "$bytes" ]; then
    cat /tmp/m/"$name".[0-9][0-9] > "/tmp/m/$name.part" && rm /tmp/m/"$name".[0-9][0-9]
    # renamed only once checked, so that a job waiting for the model never reads a half-written file
    echo "$sha  /tmp/m/$name.part" | sha256sum -c - && mv "/tmp/m/$name.part" "/tmp/m/$name.gguf" \
      || rm -f "/tmp/m/$name.part"
  else   # chunks still to come, or a carry that broke off
    size=$(stat -c %s "/tmp/m/$name.00"); parts=$(( (bytes + size - 1) / size ))
    missing=$(for i in $(seq -f %02g 0 $((parts - 1))); do [ -e "/tmp/m/$name.$i" ] || printf '%s ' "$i"; done)
    echo "$name: $held of $bytes bytes; chunks missing: ${missing:-none (one is short: carry it again)}"
  fi
done
export PYTHONPATH=/tmp/site2:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD
ls /tmp/m
