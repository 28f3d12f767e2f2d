"""`python -m tokenmill.tp_worker CONFIG_JSON`: how the launcher starts this process."""

import sys

import msgspec

from tokenmill.tp_worker.config import WorkerConfig
from tokenmill.tp_worker.worker_process import run_tp_worker

if __name__ == "__main__":
    run_tp_worker(msgspec.json.decode(sys.argv[1], type=WorkerConfig))
