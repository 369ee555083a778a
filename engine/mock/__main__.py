"""`python -m engine.mock`: mock engine-core servers (engine/mock/serve.py)."""
from engine.mock.serve import main

if __name__ == "__main__":
    raise SystemExit(main())
