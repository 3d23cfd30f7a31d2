"""DeepSpeed imported as the engine imports it where no GPU is visible (its CPU accelerator): the test
forkserver preloads it, so that a DeepSpeed worker does not import it again (about 4 CPU-s each)."""

from spikingsail.backends.deepspeed_import import import_deepspeed

import_deepspeed("the test forkserver")
