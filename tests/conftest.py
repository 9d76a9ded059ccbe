import sys
from pathlib import Path

# Test-only model factories (tests/factories.py) are importable as `factories`.
sys.path.insert(0, str(Path(__file__).parent))
