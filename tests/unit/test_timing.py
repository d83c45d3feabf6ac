"""The timers behind busy, compute and communication times: chosen by device; on CUDA they read device
time from events (a stand-in event class here, with a device clock of its own), never host time."""

import time

import pytest
import torch

from megand.core.timing import CudaEventTimer, HostTimer, device_timer


class DeviceClock:
    """Stand-ins for torch.cuda.Event: an event records the device clock, which the test advances."""

    def __init__(self):
        self.now_s, self.synchronized = 0.0, []
        clock = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.at = None

            def record(self, stream=None):
                self.at = clock.now_s

            def synchronize(self):
                clock.synchronized.append(self)

            def elapsed_time(self, end):
                assert clock.synchronized, "read before the events were waited for"
                return (end.at - self.at) * 1e3  # milliseconds, as CUDA reports

        self.Event = Event


@pytest.fixture
def clock(monkeypatch):
    clock = DeviceClock()
    monkeypatch.setattr(torch.cuda, "Event", clock.Event)
    return clock


def test_the_timer_is_chosen_by_device():
    assert isinstance(device_timer(torch.device("cpu")), HostTimer)
    assert isinstance(device_timer(torch.device("cuda", 3)), CudaEventTimer)


def test_cpu_timer_measures_host_wall_time():
    timer = device_timer(torch.device("cpu"))
    timer.start()
    time.sleep(0.02)
    timer.stop()
    assert 0.02 <= timer.seconds < 1.0
    timer.reset()
    assert timer.seconds == 0.0


def test_cuda_timer_measures_device_time_not_the_launches(clock):
    timer = device_timer(torch.device("cuda", 0))
    for device_seconds in (1.5, 0.5):  # two intervals: the host returns at once, the device works on
        timer.start()
        clock.now_s += device_seconds
        timer.stop()
        clock.now_s += 10.0  # device time outside the intervals does not count
    assert clock.synchronized == []  # nothing read (no synchronisation) until the total is asked for
    assert timer.seconds == pytest.approx(2.0)
    assert len(clock.synchronized) == 1  # one wait, for the last interval's end
    assert timer.seconds == pytest.approx(2.0)  # read once; asking again waits for nothing
    assert len(clock.synchronized) == 1
    timer.reset()
    assert timer.seconds == 0.0
