"""flexlab's Streamlit workbench: Playground, Gallery, Benchmarks and Environment pages.

Start it with ``make app`` (or ``python -m streamlit run app/streamlit_app.py``); it listens on
127.0.0.1 only, because it runs the Python typed into its editor.
"""
