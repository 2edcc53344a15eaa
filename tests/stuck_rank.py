"""Entry point for test_failure_reports: a rank stuck in a step that never ends, deaf to
the stop request a first Ctrl-C forwards (as a rank inside one long native call is)."""

import os
import signal
import time

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.write(1, b"ready\n")  # one write: two ranks' lines never interleave on the pipe
    time.sleep(600)
