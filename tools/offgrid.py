"""``python -m fa4.bench --offgrid`` (fa4/offgrid.py): kept so the device scripts' calls still work."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fa4.offgrid import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
