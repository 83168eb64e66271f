#!/usr/bin/env bash
# GPU I/O check in one invocation, for the lent GPU machine (see DESIGN.md). In order:
#   1. cuFile registration diagnosis: cuFile logs at TRACE into the work dir (a cufile.json of
#      our own through CUFILE_ENV_PATH_JSON), `gdsllm doctor --json --probe-mib 0` tests
#      cuFileHandleRegister on a file in the work dir, and the likely fixes are tried one at a
#      time (udev record variants, /run/udev/control, force_compat_mode, a mount that names
#      the real device node) until registration works; the first that works is reported,
#   2. `gdsllm doctor --json` (probe reads with every I/O path),
#   3. the gds-io GPU tests (GDSLLM_GPU_TESTS=1: they fail, not skip, without a GPU),
#   4. a synthetic 7B-shaped model (bf16-sized blobs) and `gdsllm bench-io --drop-caches` on
#      it: raw O_DIRECT (start and end of the run), buffered, host, cufile, bounce at each
#      request size (double-buffered streaming), host_to_gpu,
#   5. a summary: the table with ratios, the registration diagnosis, and the cufile.log lines
#      about udev / ID_FS / mounts / registration.
#
# Usage: scripts/gpu-io-check.sh [WORK_DIR]
# Environment (all optional):
#   GDSLLM_BIN          gdsllm release binary            (default: target/release/gdsllm)
#   GPU_TEST_BIN        gds-io test binary gpu_reads-*   (default: newest target/release/deps/gpu_reads-*)
#   WORK_DIR            disk-backed scratch directory    (default: $PWD/gpu-io-work; arg 1 wins)
#   GPU_TEST_MIB        size of the GPU tests' file       (default: 1024)
#   LAYERS, LAYER_MIB   synthetic model shape             (default: 32 × 386 MiB ≈ 7B bf16, 13.5 GB)
#   BOUNCE_MIB          bounce request sizes to sweep     (default: 1,4,8,16)
#   OUT                 where JSON results are copied     (default: $WORK_DIR/results)
#   SKIP_UDEV=1         do not touch /run/udev or mounts (diagnosis only reports)
#   SKIP_GPU_TESTS=1    skip step 3
# LD_LIBRARY_PATH should include /usr/local/cuda/lib64. Budget: ~4–6 minutes on the H100 VM.
set -uo pipefail

GPU_TEST_MIB="${GPU_TEST_MIB:-1024}"
LAYERS="${LAYERS:-32}"
LAYER_MIB="${LAYER_MIB:-386}"
BOUNCE_MIB="${BOUNCE_MIB:-1,4,8,16}"
# shellcheck source=scripts/check-common.sh
source "$(dirname "$0")/check-common.sh"
prepare_work_dir gpu-io-work "$@"
RESULTS="${OUT:-$WORK_DIR/results}"
mkdir -p "$RESULTS"
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"

if [ -z "${GPU_TEST_BIN:-}" ]; then
  GPU_TEST_BIN=$(ls -t target/release/deps/gpu_reads-* 2>/dev/null | grep -v '\.d$' | head -n1 || true)
fi

# --- cuFile logging: our own cufile.json, TRACE level, logs in the work dir --------------
CUFILE_DIR="$WORK_DIR/cufile"
mkdir -p "$CUFILE_DIR/log"
write_cufile_json() { # path force_compat(true|false) [level]
  cat >"$1" <<JSON
{
  "logging": { "dir": "$CUFILE_DIR/log", "level": "${3:-TRACE}" },
  "properties": {
    "allow_compat_mode": true,
    "force_compat_mode": $2,
    "max_direct_io_size_kb": 16384,
    "use_poll_mode": false
  },
  "fs": {
    "generic": { "posix_unaligned_writes": false },
    "ext4": {},
    "xfs": {}
  }
}
JSON
}
write_cufile_json "$CUFILE_DIR/cufile.json" false
write_cufile_json "$CUFILE_DIR/cufile-force-compat.json" true
export CUFILE_ENV_PATH_JSON="$CUFILE_DIR/cufile.json"

# --- 1. registration diagnosis -----------------------------------------------------------
step "cuFile registration diagnosis (work dir $WORK_DIR)"
majmin=$(stat -c '%Hd:%Ld' "$WORK_DIR")
read -r mnt_source mnt_fstype mnt_target < <(findmnt -no SOURCE,FSTYPE,TARGET -T "$WORK_DIR" | head -n1)
record="/run/udev/data/b$majmin"
sysdev="/sys/dev/block/$majmin"
devname=$(sed -n 's/^DEVNAME=//p' "$sysdev/uevent" 2>/dev/null)
devtype=$(sed -n 's/^DEVTYPE=//p' "$sysdev/uevent" 2>/dev/null)
{
  echo "device $majmin ($devname, $devtype), mount source $mnt_source, fstype $mnt_fstype, mountpoint $mnt_target"
  echo "udev record $record: $( [ -e "$record" ] && tr '\n' ' ' <"$record" || echo absent)"
  echo "/run/udev/control: $( [ -e /run/udev/control ] && echo present || echo absent); udevd: $(pgrep -x systemd-udevd >/dev/null && echo running || echo 'not running')"
  echo "/dev/$devname: $(ls -l "/dev/$devname" 2>&1)"
  echo "libudev: $(ldconfig -p 2>/dev/null | grep -m1 -o 'libudev.so[^ ]*' || echo 'not in ldconfig cache')"
} | tee "$RESULTS/diagnosis.txt" >&2

REG_HOME="$WORK_DIR/home"
export GDSLLM_HOME="$REG_HOME"
reg_test() { # label; prints ok/FAILED, returns 0 when registration works
  local label=$1 json="$RESULTS/reg-$2.json"
  mkdir -p "$GDSLLM_HOME"
  "$BIN" doctor --json --probe-mib 0 --home "$GDSLLM_HOME" >"$json" 2>"$RESULTS/reg-$2.log"
  local verdict
  verdict=$(python3 -c '
import json, sys
r = json.load(open(sys.argv[1])).get("cufile_registration")
print("no-cufile" if r is None else ("ok" if r["ok"] else "FAILED: " + (r.get("error") or "?")))
' "$json" 2>/dev/null || echo "doctor failed")
  echo "[$2] $label -> $verdict" | tee -a "$RESULTS/diagnosis.txt" >&2
  [ "$verdict" = ok ]
}
write_record() { # lines...
  $SUDO mkdir -p /run/udev/data && printf '%s\n' "$@" | $SUDO tee "$record" >/dev/null
}
usec_now=$(awk '{printf "%d", $1 * 1000000}' /proc/uptime)
fs_uuid=$(blkid -s UUID -o value "/dev/$devname" 2>/dev/null || findmnt -no UUID -T "$WORK_DIR" 2>/dev/null || true)
registration_fix="none worked"
MOUNTED_ALIAS=""
cleanup() { [ -n "$MOUNTED_ALIAS" ] && $SUDO umount "$MOUNTED_ALIAS" 2>/dev/null; }
trap cleanup EXIT

if reg_test "as found" 0; then
  registration_fix="none needed"
elif [ "${SKIP_UDEV:-0}" = 1 ]; then
  echo "SKIP_UDEV=1: no fixes tried" >&2
elif [ "${majmin%%:*}" = 0 ]; then
  echo "work dir is on a virtual filesystem ($mnt_fstype); cuFile cannot register files there" >&2
else
  [ -e "$record" ] && cp "$record" "$RESULTS/udev-record-as-found.txt"
  if write_record "E:ID_FS_USAGE=filesystem" && reg_test "record with only E:ID_FS_USAGE=filesystem" 1; then
    registration_fix="1: udev record E:ID_FS_USAGE=filesystem"
  elif write_record "I:$usec_now" "E:ID_FS_USAGE=filesystem" "E:ID_FS_TYPE=$mnt_fstype" \
        ${fs_uuid:+"E:ID_FS_UUID=$fs_uuid"} "E:ID_FS_VERSION=1.0" "G:systemd" "Q:systemd" "V:1" \
      && reg_test "full record: I:<usec since boot>, ID_FS_USAGE, ID_FS_TYPE=$mnt_fstype, ID_FS_UUID" 2; then
    registration_fix="2: full udev record (I: line + ID_FS_TYPE/UUID)"
  elif $SUDO mkdir -p /run/udev && $SUDO touch /run/udev/control && reg_test "full record + /run/udev/control" 3; then
    registration_fix="3: full record + /run/udev/control"
  elif CUFILE_ENV_PATH_JSON="$CUFILE_DIR/cufile-force-compat.json" reg_test "full record + control + force_compat_mode" 4; then
    registration_fix="4: cufile.json properties.force_compat_mode=true"
    export CUFILE_ENV_PATH_JSON="$CUFILE_DIR/cufile-force-compat.json"
  else
    # cuFile matches the volume to the mount table by device node name; a kernel root mount
    # shows up as /dev/root. A second mount of the same filesystem through /dev/<name> gives
    # the mount table an entry cuFile can match, and shows the same files.
    node="/dev/$devname"
    if [ -n "$devname" ] && [ ! -b "$node" ]; then
      $SUDO mknod "$node" b "${majmin%%:*}" "${majmin##*:}" && echo "created $node" >&2
    fi
    alias_mnt="/mnt/gdsllm-$devname"
    if [ -n "$devname" ] && $SUDO mkdir -p "$alias_mnt" && $SUDO mount -t "$mnt_fstype" "$node" "$alias_mnt" 2>"$RESULTS/mount.log"; then
      MOUNTED_ALIAS="$alias_mnt"
      rel="${WORK_DIR#"$mnt_target"}"
      ALIAS_WORK="$alias_mnt/${rel#/}"
      echo "mounted $node at $alias_mnt; work dir seen there as $ALIAS_WORK" >&2
      if GDSLLM_HOME="$ALIAS_WORK/home" reg_test "file opened through a mount of $node (not $mnt_source)" 5; then
        registration_fix="5: mount table entry naming $node (was $mnt_source)"
        WORK_DIR="$ALIAS_WORK"; export GDSLLM_HOME="$ALIAS_WORK/home"
      fi
    else
      echo "could not mount $node at $alias_mnt: $(cat "$RESULTS/mount.log")" >&2
    fi
  fi
fi
echo "registration fix: $registration_fix" | tee -a "$RESULTS/diagnosis.txt" >&2

# --- 2. doctor -------------------------------------------------------------------------
step "gdsllm doctor --json"
if "$BIN" doctor --json --probe-mib 512 >"$RESULTS/doctor.json"; then
  cat "$RESULTS/doctor.json"
else
  echo "doctor FAILED" >&2; status=1
fi

# --- 3. GPU tests ----------------------------------------------------------------------
gpu_tests="skipped"
if [ "${SKIP_GPU_TESTS:-0}" != 1 ]; then
  step "gds-io GPU tests (GDSLLM_GPU_TESTS=1, ${GPU_TEST_MIB} MiB file)"
  if [ -n "$GPU_TEST_BIN" ] && [ -x "$GPU_TEST_BIN" ]; then
    if GDSLLM_GPU_TESTS=1 GDSLLM_GPU_TEST_DIR="$WORK_DIR" GDSLLM_GPU_TEST_MIB="$GPU_TEST_MIB" \
        "$GPU_TEST_BIN" --test-threads=1 --nocapture 2>&1 | tee "$RESULTS/gpu_tests.log"; then
      gpu_tests="passed"
    else
      gpu_tests="FAILED"; status=1
    fi
  else
    echo "no gds-io GPU test binary (set GPU_TEST_BIN)" >&2; gpu_tests="missing"; status=1
  fi
fi

# --- 4. synthetic model + bench-io -----------------------------------------------------
step "synthetic model: gdsllm synth --shape llama-7b --dtype f16 (${SYNTH_LAYERS:-32} layers)"
MODEL="$WORK_DIR/synth7b"
if [ ! -f "$MODEL/metadata.json" ]; then
  rm -rf "$MODEL"
  "$BIN" synth --shape llama-7b --layers "${SYNTH_LAYERS:-32}" --dtype f16 "$MODEL" --json >"$RESULTS/synth.json" \
    || { echo "synth FAILED" >&2; status=1; }
  cat "$RESULTS/synth.json" >&2
  sync
fi
du -sh "$MODEL" >&2

# TRACE logging costs time per I/O: the timed reads log errors only.
write_cufile_json "$CUFILE_DIR/cufile.json" false ERROR
write_cufile_json "$CUFILE_DIR/cufile-force-compat.json" true ERROR
step "gdsllm bench-io (bounce request sizes $BOUNCE_MIB MiB, page cache dropped before each)"
if "$BIN" bench-io -m "$MODEL" --json --drop-caches --bounce-request-mib "$BOUNCE_MIB" \
    >"$RESULTS/bench_io.json"; then
  bench="ok"
else
  echo "bench-io FAILED" >&2; bench="FAILED"; status=1
fi

# --- 5. summary ------------------------------------------------------------------------
step "summary"
cat "$CUFILE_DIR"/log/*.log ./cufile*.log 2>/dev/null >"$RESULTS/cufile-all.log"
python3 - "$RESULTS/doctor.json" "$RESULTS/bench_io.json" "$gpu_tests" "$registration_fix" <<'PY'
import json, sys
def load(p):
    try:
        return json.load(open(p))
    except Exception as e:
        return {"error": str(e)}
doctor, bench, tests, fix = load(sys.argv[1]), load(sys.argv[2]), sys.argv[3], sys.argv[4]
print(f"doctor: {doctor.get('summary')}; GPU {doctor.get('gpu', {}).get('name')}; "
      f"compat_mode={doctor.get('compat_mode')} nvidia_fs={doctor.get('nvidia_fs')} p2pdma={doctor.get('p2pdma')}")
reg = doctor.get("cufile_registration") or {}
print(f"cuFile registration: {'ok' if reg.get('ok') else 'FAILED: ' + str(reg.get('error'))}; fix that worked: {fix}")
print(f"gds-io GPU tests: {tests}")
if "raw_gbps" in bench:
    print(f"bench-io: {bench['files']} files, {bench['bytes']/1e9:.2f} GB, cuFile path: {bench.get('cufile_path')}")
    runs = ", ".join(f"{g:.2f}" for g in bench.get("raw_runs", []))
    print(f"{'read':<16}{'GB/s':>8}{'x raw':>8}  target  pattern")
    print(f"{'raw O_DIRECT':<16}{bench['raw_gbps']:>8.2f}{1.0:>8.2f}          "
          f"{bench.get('raw_threads')} threads x {bench.get('raw_request_mib')} MiB, runs {runs}")
    if bench.get("buffered_gbps"):
        print(f"{'buffered (cp)':<16}{bench['buffered_gbps']:>8.2f}{bench['buffered_gbps']/bench['raw_gbps']:>8.2f}")
    for b in bench["backends"]:
        target = 0.95 if b["name"].startswith("bounce") else 0.90
        name = b["name"] + (f" ({bench.get('cufile_path')})" if b["name"] == "cufile" else "")
        if b.get("gbps") is not None:
            verdict = "ok" if b["ratio"] >= target else "BELOW"
            print(f"{name:<16}{b['gbps']:>8.2f}{b['ratio']:>8.2f}  {target:.2f} {verdict:<5} {b.get('pattern')}")
        else:
            print(f"{name:<16} unavailable: {b.get('error')}")
else:
    print(f"bench-io: {bench.get('error')}")
PY
echo
echo "registration attempts:"; grep '^\[' "$RESULTS/diagnosis.txt"
echo
echo "cufile.log lines about udev / ID_FS / mount / volume / registration / 5027 (last 40; all in $RESULTS/cufile-all.log):"
grep -aiE 'udev|ID_FS|5027|regist|mount|volume|block dev|unsupported|not supported|compat' \
  "$RESULTS/cufile-all.log" | sed -E 's/^.*\] +//' | sort | uniq -c | sort -rn | head -n 40
exit $status
