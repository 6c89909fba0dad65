import os
import sys

# tests import helpers as `from _dist import ...`
sys.path.insert(0, os.path.dirname(__file__))
