"""On PYTHONPATH for a sanitized test run (docs/contributing.md, "Sanitizers"): an editable install of pydflash
(`pip install -e .`) puts an import hook ahead of PYTHONPATH that would load the uninstrumented build; dropping it
lets `import pydflash` find the sanitized one in build/asan-site."""

import sys

sys.meta_path[:] = [finder for finder in sys.meta_path if not type(finder).__name__.startswith("ScikitBuild")]
