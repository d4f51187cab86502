"""The parts of ``bench/putget.py`` (the entry point: its docstring says what is measured, the
floors and predictions written before measuring, and the findings).

fixtures    the 64 KiB-block layout, engine configs, tensors, keys, /dev/shm paths, timing loops
throughput  part 1: one Engine's put_kv / get_kv against torch copy_, with the phase split
handoff     part 2: producer put_kv -> consumer get_kv across two processes, against NIXL
lookup      part 3: lookup and block_keys rates and their floors
report      the printed tables and the verdict on every target
"""
