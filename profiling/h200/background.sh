#!/usr/bin/env bash
# GPU work that outlasts one device call. The device machine keeps a process that started its own session (setsid)
# running until the machine goes back, and keeps /tmp while warm (~30 s after each call), so a queue started in one
# call goes on while later calls carry model chunks or wait; the model loads and the kernels compile once.
#
#   source profiling/h200/setup.sh && bash profiling/h200/background.sh start JOBS
#       copy this checkout (without the carried folders) to /tmp/bg/repo and run JOBS's lines there, one after
#       another, each as `bash -c LINE` with BG_OUT=/tmp/bg/out; '#' lines are skipped. A line `await FILE` waits
#       (up to an hour) for FILE, e.g. the model that setup.sh joins once its last chunk is carried.
#   bash profiling/h200/background.sh wait SECONDS [DIR ...]
#       wait until the queue ends or SECONDS pass, print the log's tail, and pack /tmp/bg/out, the log and each
#       DIR into $OUT/bg.tar.xz (one file: the device returns at most 8), so that a lost machine loses little.
set -uo pipefail
BG=/tmp/bg
case "${1:-}" in
  start)
    jobs=$2
    [ -f "$jobs" ] || { echo "no job file $jobs" >&2; exit 2; }
    if [ -e $BG/pid ] && kill -0 "$(cat $BG/pid)" 2>/dev/null; then echo "a queue is running already" >&2; exit 2; fi
    mkdir -p $BG/repo $BG/out
    tar --exclude=./.q50 --exclude=./.fa4a --exclude=./.fa4b --exclude=./.whl -cf - . | tar -xf - -C $BG/repo
    cp "$jobs" $BG/jobs
    p=${PYTHONPATH:-}; export PYTHONPATH=${p//$PWD/$BG/repo} BG_OUT=$BG/out
    [ -e $BG/log ] && mv $BG/log $BG/log.prev
    setsid nohup bash $BG/repo/profiling/h200/background.sh run $BG/jobs > /dev/null 2>&1 < /dev/null &
    echo $! > $BG/pid
    echo "queue started (pid $(cat $BG/pid)): $(grep -cv '^\s*\(#\|$\)' "$jobs") jobs, log $BG/log"
    ;;
  run)   # the queue itself (started by `start`)
    cd $BG/repo || exit 1
    n=0
    while IFS= read -r line; do
      case "$line" in ''|'#'*) continue ;; esac
      n=$((n + 1))
      echo "== $(date +%T) job $n: $line" >> $BG/log
      start=$(date +%s)
      if [[ $line == await\ * ]]; then
        file=${line#await }
        for _ in $(seq 720); do [ -s "$file" ] && break; sleep 5; done
        [ -s "$file" ]; rc=$?
      else
        bash -c "$line" >> $BG/log 2>&1; rc=$?
      fi
      echo "== $(date +%T) job $n rc $rc in $(( $(date +%s) - start )) s" >> $BG/log
    done < "$2"
    echo "== $(date +%T) queue done" >> $BG/log
    ;;
  wait)
    seconds=${2:-0}; shift 2 || shift $#
    end=$(( $(date +%s) + seconds ))
    while [ "$(date +%s)" -lt "$end" ] && ! grep -q "queue done" $BG/log 2>/dev/null; do sleep 5; done
    grep -a "^== " $BG/log | tail -n 12
    tail -c 1500 $BG/log | tr '\r' '\n' | grep -av "^== " | tail -n 8
    if [ -n "${OUT:-}" ]; then
      tar -cJf "$OUT/bg.tar.xz" -C / "${BG#/}/out" "${BG#/}/log" "${@#/}" 2>/dev/null
      ls -la "$OUT/bg.tar.xz"
    fi
    ;;
  *)
    echo "usage: $0 start JOBS | wait SECONDS [DIR ...]" >&2; exit 2 ;;
esac
