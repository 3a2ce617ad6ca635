"""Usage reports over HTTP: admins see every tenant (`/admin/usage/report`), a tenant its own (`/v1/usage`)."""

from __future__ import annotations

from typing import Annotated, Any

from litestar import Request, Response, get
from litestar.di import NamedDependency, Provide
from litestar.params import FromQuery, QueryParameter

from gateway.auth import provide_tenant
from gateway.errors import InvalidRequest
from gateway.query_params import QUERY_OPT, query_names, refuse_unknown
from gateway.report_format import to_csv
from gateway.report_gate import ADMIN_SLOT, ReportGate
from gateway.report_params import BY_PATTERN, DAY_PATTERN, ReportParamError, parse_by_query, parse_day
from gateway.routes.guarded import admin_only
from gateway.routes.openapi import BEARER, also, errors
from gateway.tenants.records import Principal
from gateway.tenants.store import TenantStore
from quotas.ledger import Ledger
from quotas.report import COLUMNS, jsonable

# what the document says of the query, as `_report` parses it: a comma list of distinct groups (`day` 5,000 times
# was a 500, SQLite's "too many columns"), checked by parse_by_query, whose refusals say what is wrong; a day
By = Annotated[str | None, QueryParameter(schema_extra={"pattern": BY_PATTERN},
                                          description="groups, comma-separated, each at most once")]
Day = Annotated[str | None, QueryParameter(schema_extra={"pattern": f"^{DAY_PATTERN}$"},
                                           description="YYYY-MM-DD, UTC, inclusive")]
# `from` (a Python keyword) by its alias: it was read from the query by hand, and so was missing from the published
# document of both reports, which refused it nowhere; the days are checked by `_day`, whose refusal is in words ("is
# not a date like 2026-11-30"), not Litestar's regex
Since = Annotated[str | None, QueryParameter(name="from", schema_extra={"pattern": f"^{DAY_PATTERN}$"},
                                             description="YYYY-MM-DD, UTC, inclusive")]
# a plain string the document declares as the enum, checked by `_report`, whose refusal names the two formats (a
# Literal was refused by Litestar's own words, "Invalid enum value 'xml'", which did not say what to send)
Format = Annotated[str, QueryParameter(schema_extra={"enum": ["json", "csv"]}, description="json or csv")]


_QUERY = ("from", "to", "by", "format")  # the query parameters of a tenant's report; an admin's adds `tenant`


async def _report(ledger: Ledger, gate: ReportGate, who: str, *, tenant: str | None, since: str | None,
                  until: str | None, by: str | None, fmt: str) -> Response[Any]:
    if fmt not in ("json", "csv"):
        raise InvalidRequest(f"format: {fmt[:16]!r} is not a format; use json or csv", param="format",
                             code="invalid_value")
    try:
        groups, since_s, until_s = parse_by_query(by), _day(since), _day(until, end=True)
    except ReportParamError as exc:
        raise InvalidRequest(f"{exc.param}: {exc}", param=exc.param, code=exc.code) from exc
    if since_s is not None and until_s is not None and since_s >= until_s:  # an empty report, read as no use
        raise InvalidRequest(f"from: {since} is after to ({until})", param="from", code="invalid_value")
    try:
        # read and summed in a report process, waited on by a report thread, one report per tenant at a time: a
        # tenant's history grows with every request, and neither the event loop, nor the request path's threads,
        # nor the gateway's interpreter may wait on it
        rows = await gate.report(who, ledger, by=groups, since=since_s, until=until_s, tenant=tenant)
    except ValueError as exc:
        raise InvalidRequest(str(exc), code="invalid_value") from exc
    if fmt == "csv":
        return Response(to_csv(rows, header=(*groups, *COLUMNS)), media_type="text/csv")
    return Response({"object": "list", "by": list(groups), "data": jsonable(rows)})


def _day(text: str | None, *, end: bool = False) -> float | None:
    """parse_day, with an empty day (`?from=`) refused as any other that is not a date: it was read as no bound, and
    `?from=` from a client whose start was unset answered the tenant's whole history."""
    if text == "":
        raise ReportParamError("'' is not a date like 2026-11-30; send one, or leave the parameter out",
                               param="to" if end else "from")
    return parse_day(text, end=end)


@get("/admin/usage/report", tags=["admin"], security=BEARER, opt={QUERY_OPT: (*_QUERY, "tenant")},
     responses=errors(400, 401, 403, 404, 429, 500, 503), operation_class=also("text/csv"))
async def admin_report(ledger: NamedDependency[Ledger],
                       reports: NamedDependency[ReportGate], store: NamedDependency[TenantStore],
                       tenant: FromQuery[str | None] = None, since: Since = None,
                       to: Day = None, by: By = None,
                       format: Format = "json") -> Response[Any]:
    """Query: from, to (YYYY-MM-DD, UTC, inclusive), by (tenant,tier,day,key_id), tenant, format (json|csv).

    A `tenant` the store does not have is a 404 naming it: a misspelt name (a capital, a trailing space) answered
    a report of no usage, which finance reads as a tenant that used nothing."""
    if tenant is not None:
        await store.admin(store.get_tenant, tenant)
    return await _report(ledger, reports, ADMIN_SLOT, tenant=tenant, since=since, until=to, by=by, fmt=format)


admin_report_router = admin_only(admin_report)


@get("/v1/usage", dependencies={"principal": Provide(provide_tenant)}, tags=["usage"], security=BEARER,
     responses=errors(400, 401, 403, 429, 500, 503), operation_class=also("text/csv"))
async def tenant_report(request: Request[Any, Any, Any], principal: NamedDependency[Principal],
                        ledger: NamedDependency[Ledger], reports: NamedDependency[ReportGate],
                        since: Since = None, to: Day = None, by: By = None,
                        format: Format = "json") -> Response[Any]:
    """The caller's own tenant only; same query as the admin report."""
    # as only_declared_query does on the admin report, after the key (a dependency here): a query parameter the report
    # does not take (`?tenant=` on a tenant's report, `?form=` for `from`) or one sent twice is refused by name
    refuse_unknown(query_names(request), _QUERY)
    tenant = principal.tenant.name  # type: ignore[union-attr]
    return await _report(ledger, reports, tenant, tenant=tenant, since=since, until=to, by=by, fmt=format)
