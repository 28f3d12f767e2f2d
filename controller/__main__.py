"""`python -m tokenmill.controller CONFIG_JSON`: how the launcher starts this process."""

import sys

import msgspec

from tokenmill.controller.config import ControllerConfig
from tokenmill.controller.controller import run_controller

if __name__ == "__main__":
    run_controller(msgspec.json.decode(sys.argv[1], type=ControllerConfig))
