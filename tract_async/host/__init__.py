"""Host tuning the data plane asks of the operating system, each a request that degrades to a
warning where it is not permitted: timer slack for short sleeps (``timerslack``), CPU wake-up
latency (``cpu_qos``), and the garbage collector held off large copies (``gcpause``)."""
