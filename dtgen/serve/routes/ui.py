"""`GET /`: the one-page UI (dtgen/serve/ui.html), which drives the job routes."""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter()

UI_PAGE = Path(__file__).parents[1] / "ui.html"


@router.get("/", response_class=HTMLResponse)
async def page():
    return UI_PAGE.read_text()
