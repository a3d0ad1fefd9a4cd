"""Routes of the web UI."""

from django.urls import path

from webui import views

app_name = "webui"

urlpatterns = [
    path("", views.index, name="index"),
]
