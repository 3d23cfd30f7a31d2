"""torchft's ``torchft_lighthouse`` program without its import of the ``torchft`` package, which
imports torch (2 s and more on a busy machine): torchft's Rust extension alone starts in a tenth of
a second, so that ``sail launch`` sees the lighthouse serve before it starts the groups.

Run as a file, ``python torchft_lighthouse.py --min_replicas 1 --bind HOST:PORT ...``, with the
lighthouse's own options (torchft reads them from the command line after the program's path)."""

import sys

if __name__ == "__main__":
    del sys.path[0]  # this file's directory: nothing of it may shadow what follows
    import importlib.util
    from pathlib import Path

    package = importlib.util.find_spec("torchft")
    assert package is not None and package.submodule_search_locations
    library = next(Path(package.submodule_search_locations[0]).glob("_torchft.*"))
    spec = importlib.util.spec_from_file_location("torchft._torchft", library)
    assert spec is not None and spec.loader is not None
    torchft = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(torchft)
    sys.exit(torchft.lighthouse_main())
