"""Routes of the web UI (the dashboard); the login pages are in controlplane/urls.py."""

from django.urls import path

from webui import views

app_name = "webui"

urlpatterns = [
    path("", views.index, name="index"),
    path("jobs/", views.jobs, name="jobs"),
    path("jobs/<int:pk>/", views.job_detail, name="job"),
    path("jobs/<int:pk>/parts/", views.job_parts, name="parts"),
    path("jobs/<int:pk>/nodes/<str:name>/", views.node_detail, name="node"),
    path("jobs/<int:pk>/what-if/", views.what_if, name="what_if"),
    path("jobs/<int:pk>/drills/", views.job_drill, name="drill"),
    path("recoveries/<int:pk>/", views.recovery_detail, name="recovery"),
    path("recoveries/<int:pk>/state/", views.recovery_state, name="state"),
    path("recoveries/<int:pk>/proposal/", views.recovery_proposal, name="proposal"),
    path("recoveries/<int:pk>/approve/", views.recovery_approve, name="approve"),
    path("recoveries/<int:pk>/override/", views.recovery_override, name="override"),
    path("recoveries/<int:pk>/dismiss/", views.recovery_dismiss, name="dismiss"),
    path("attention/", views.attention, name="attention"),
    path("incidents/", views.incidents, name="incidents"),
    path("simulations/", views.simulations, name="simulations"),
    path("simulations/<int:pk>/", views.simulation_detail, name="simulation"),
]
