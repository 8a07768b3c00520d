"""The OpenAI server: protocol, app factory (``app.create_app``), admission, shutdown. Imports the engine."""
