"""`gputrace record`: run a command, sample it from outside, collect in-process shards."""

import os

BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")
