"""The stop request: a real signal is recorded (not acted on) while installed, handlers are
restored afterwards, and in one process the agreement is the process's own flag. The
multi-rank agreement (SIGTERM to one rank of two) is tested end to end in
``tests/e2e/test_train.py``."""

from __future__ import annotations

import os
import signal

from focus_pretrain.train import StopSignal


def test_a_signal_is_recorded_and_agreed_on():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignal() as stop:
        assert not stop.should_stop() and stop.agreed is None
        os.kill(os.getpid(), signal.SIGTERM)  # would end the process without the handler
        assert stop.received == signal.SIGTERM
        assert stop.should_stop() and stop.agreed == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


def test_only_the_chosen_signals_are_caught():
    before = signal.getsignal(signal.SIGINT)
    with StopSignal(signals=(signal.SIGUSR1,)) as stop:
        assert signal.getsignal(signal.SIGINT) is before
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.should_stop() and stop.agreed == signal.SIGUSR1
