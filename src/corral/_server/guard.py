# temporary: removed when _ui/_control import corral._http directly (issue 39)
from .._http.guard import UI_HEADER, session_cookie_name

__all__ = ["UI_HEADER", "session_cookie_name"]
