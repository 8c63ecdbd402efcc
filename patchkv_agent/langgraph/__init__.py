"""LangGraph / LangChain integration (see DESIGN.md section 6)."""
