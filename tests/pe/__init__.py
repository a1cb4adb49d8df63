"""A package, so that its test modules may share a basename with another folder's (pytest imports
this folder's test_oracle.py as ``pe.test_oracle``, tests/attention's as ``test_oracle``).
tests/attention stays a plain folder: test_serving_layouts.py imports test_serving by bare name."""
