"""Code the test files share (the tests directory is on sys.path under pytest): `from helpers.server import ...`.

Test modules import helpers from here, never from each other; fixtures live in tests/conftest.py."""
