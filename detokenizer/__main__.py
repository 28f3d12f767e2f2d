"""`python -m tokenmill.detokenizer CONFIG_JSON`: how the launcher starts this process."""

import sys

import msgspec

from tokenmill.detokenizer.config import DetokenizerConfig
from tokenmill.detokenizer.detokenizer import run_detokenizer

if __name__ == "__main__":
    run_detokenizer(msgspec.json.decode(sys.argv[1], type=DetokenizerConfig))
