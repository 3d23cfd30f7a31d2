"""Imported last in the test forkserver (``tests.multiprocess.PRELOAD``): what the server has built
by then — torch's, dynamo's and SpikingSail's modules, a million objects — leaves the garbage
collector's reach (``gc.freeze``, as CPython's documentation advises before forking without exec).
Without it the first full collection in each forked rank walks all of it: 0.23 of a forked rank's
0.7 CPU-s in ``tests/checkpoint/test_world_size.py``, and it writes to every page it walks, which
the fork then copies.
"""

import gc

gc.collect()
gc.freeze()
