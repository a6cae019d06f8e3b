"""flexlab's Streamlit workbench: Playground, Gallery, Benchmarks and Environment pages.

Start it with ``make app`` (or ``python -m streamlit run app/streamlit_app.py``). It listens on
127.0.0.1 only, because it runs the Python typed into its editor (in its worker process, with the
user's own rights); experiments are kept in a SQLite database in the data folder (see
:mod:`app.settings`).
"""
