"""``python -m coat_jax.generate``: sample from a run, a Hugging Face folder or a GGUF file.

The command line lives here, not in the package's ``__init__``, so that ``python -m`` runs a module
the package has not imported already (``coat_jax`` imports ``coat_jax.generate`` for its exports).
"""

import sys

from coat_jax.generate import main

if __name__ == "__main__":
    sys.exit(main())
