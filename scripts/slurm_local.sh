#!/usr/bin/env bash
# A one-machine SLURM cluster for tests and trials: slurmctld and slurmd on this host, munge for
# authentication, and 8 stand-in GPUs (GRES backed by character devices like /dev/null), so that
# scripts/slurm.sbatch's --gpus-per-node works on a machine without GPUs.
#
#   bash scripts/slurm_local.sh install      # Debian's slurm-wlm and munge, when missing (root, apt)
#   bash scripts/slurm_local.sh start DIR    # config, state and logs in DIR; prints SLURM_CONF=...
#   bash scripts/slurm_local.sh stop DIR
#
# Then: SLURM_CONF=DIR/slurm.conf sbatch ... (tests/test_slurm.py does this). Needs root: slurmd
# runs jobs as their users and munged reads its key from /etc/munge. The cluster is one node,
# named after this host, with this machine's CPUs and memory; a requeued job waits SLURM's
# 2 minutes unless released (scontrol update jobid=N StartTime=now).
set -euo pipefail

need() {
  for cmd in slurmctld slurmd sbatch munged; do
    command -v "$cmd" >/dev/null 2>&1 || { echo "slurm_local: $cmd is not installed (bash $0 install)" >&2; return 1; }
  done
  [[ $(id -u) -eq 0 ]] || { echo "slurm_local: slurmd and munged must run as root" >&2; return 1; }
}

case "${1:-}" in
install)
  if need 2>/dev/null; then echo "slurm_local: slurm and munge are installed"; exit 0; fi
  [[ $(id -u) -eq 0 ]] || { echo "slurm_local: installing needs root (apt-get)" >&2; exit 1; }
  command -v apt-get >/dev/null || { echo "slurm_local: no apt-get on this machine: install slurm-wlm and munge" >&2; exit 1; }
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q slurm-wlm munge >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q slurm-wlm munge >/dev/null; }
  echo "slurm_local: installed $(slurmctld -V)"
  ;;
start)
  dir=$(realpath -m "${2:?usage: $0 start DIR}")
  need
  mkdir -p "$dir"/{state,spool,log,run,dev}
  for i in 0 1 2 3 4 5 6 7; do  # stand-in GPUs: SLURM wants a device file per GPU (/dev/null's numbers)
    [[ -e $dir/dev/gpu$i ]] || mknod "$dir/dev/gpu$i" c 1 3
  done
  cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 8 / 10 ))
  host=$(hostname -s)
  cat > "$dir/slurm.conf" <<EOF
ClusterName=meshpar-local
GresTypes=gpu
SlurmctldHost=$host
SlurmctldPort=${SLURMCTLD_PORT:-6817}
SlurmdPort=${SLURMD_PORT:-6818}
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
KillWait=30
NodeName=$host CPUs=$cpus RealMemory=$mem Gres=gpu:8 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
  printf 'AutoDetect=off\nNodeName=%s Name=gpu File=%s/dev/gpu[0-7]\n' "$host" "$dir" > "$dir/gres.conf"
  if ! pgrep -x munged >/dev/null; then
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
    [[ -s /etc/munge/munge.key ]] || { mkdir -p /etc/munge && dd if=/dev/urandom of=/etc/munge/munge.key bs=128 count=1 status=none && chown munge:munge /etc/munge/munge.key 2>/dev/null; chmod 400 /etc/munge/munge.key; }
    munged --force 2>/dev/null || munged
  fi
  export SLURM_CONF=$dir/slurm.conf
  slurmctld -c
  slurmd
  for _ in $(seq 1 50); do  # the node registers within a few seconds
    [[ $(sinfo -h -o %T 2>/dev/null) == idle ]] && break
    sleep 0.2
  done
  [[ $(sinfo -h -o %T) == idle ]] || { echo "slurm_local: the node did not come up; see $dir/log" >&2; exit 1; }
  echo "SLURM_CONF=$dir/slurm.conf"
  ;;
stop)
  dir=$(realpath -m "${2:?usage: $0 stop DIR}")
  export SLURM_CONF=$dir/slurm.conf
  scancel --full --quiet --user "$(id -un)" 2>/dev/null || true
  for daemon in slurmd slurmctld; do
    pidfile=$dir/run/$daemon.pid
    if [[ -s $pidfile ]]; then
      pid=$(cat "$pidfile")
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done  # its ports free again
    fi
  done
  ;;
*)
  echo "usage: $0 install | start DIR | stop DIR" >&2
  exit 2
  ;;
esac
