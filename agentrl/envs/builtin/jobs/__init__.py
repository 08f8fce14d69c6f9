"""``jobs``: a professional-network workflow env over a real local HTTP service (FastAPI on uvicorn)."""
