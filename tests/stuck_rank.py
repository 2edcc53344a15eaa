"""Entry point for test_failure_reports: a rank stuck in a step that never ends, deaf to
the stop request a first Ctrl-C forwards (as a rank inside one long native call is)."""

import signal
import time

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print("ready", flush=True)
    time.sleep(600)
