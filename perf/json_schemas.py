"""Real-world-style JSON schemas, each with a short request in words, for the guided-JSON
benchmarks (perf/bench_json_whitespace.py). Written for this repository, in the shapes APIs
and apps ask models for: records with required keys, enums, nested objects, arrays of
objects, bounds, patterns and formats, and `oneOf` of tagged variants. The requests do not
show the schema: the guide alone keeps the answer inside it, as with OpenAI's
`response_format`."""

from __future__ import annotations

_S = {"type": "string"}
_I = {"type": "integer"}
_N = {"type": "number"}
_B = {"type": "boolean"}


def _obj(props: dict, required: list[str] | None = None, closed: bool = True) -> dict:
    out = {"type": "object", "properties": props, "required": list(props) if required is None else required}
    if closed:
        out["additionalProperties"] = False
    return out


def _arr(items: dict, lo: int | None = None, hi: int | None = None) -> dict:
    out = {"type": "array", "items": items}
    if lo is not None:
        out["minItems"] = lo
    if hi is not None:
        out["maxItems"] = hi
    return out


ADDRESS = _obj({"street": _S, "city": _S, "postal_code": _S, "country": _S})

# (name, the request in words, schema); None: any JSON object (response_format json_object)
SCHEMAS: list[tuple[str, str, dict | None]] = [
    ("person_object", "Give me a small JSON object describing a person with a name and an age.", None),
    ("settings_object", "Return the display settings of a phone as a JSON object.", None),
    ("person", "Describe a fictional person as JSON: name and age.", _obj({"name": _S, "age": {**_I, "minimum": 0, "maximum": 130}})),
    ("contact", "Make a contact card as JSON for a plumber called Ana.",
     _obj({"name": _S, "email": {**_S, "format": "email"}, "phone": _S, "company": _S}, ["name", "email"])),
    ("address", "Write the address of a bakery in Lyon as JSON.", ADDRESS),
    ("user_profile", "Create a user profile as JSON for a new member of a hiking club.",
     _obj({"username": {**_S, "pattern": "^[a-z0-9_]{3,16}$"}, "full_name": _S, "age": _I, "address": ADDRESS,
           "interests": _arr(_S, 1, 5)})),
    ("product", "Give the product listing of a wireless mouse as JSON.",
     _obj({"sku": _S, "name": _S, "price": {**_N, "minimum": 0}, "currency": {"enum": ["USD", "EUR", "GBP"]},
           "in_stock": _B, "tags": _arr(_S, 0, 5)})),
    ("order", "Write an online order of two books as JSON.",
     _obj({"order_id": _S, "customer": _S, "items": _arr(_obj({"title": _S, "quantity": {**_I, "minimum": 1},
                                                               "unit_price": _N}), 1, 5),
           "total": _N, "status": {"enum": ["pending", "paid", "shipped", "delivered"]}})),
    ("invoice", "Produce an invoice for two hours of consulting as JSON.",
     _obj({"invoice_number": _S, "date": {**_S, "format": "date"}, "bill_to": _S,
           "lines": _arr(_obj({"description": _S, "hours": _N, "rate": _N}), 1, 4), "total_due": _N})),
    ("event", "Describe a concert next Friday as a JSON calendar event.",
     _obj({"title": _S, "start": {**_S, "format": "date-time"}, "end": {**_S, "format": "date-time"}, "location": _S,
           "all_day": _B}, ["title", "start", "location"])),
    ("weather", "Report today's weather in Oslo as JSON.",
     _obj({"city": _S, "temperature_c": _N, "condition": {"enum": ["sunny", "cloudy", "rain", "snow", "fog"]},
           "humidity": {**_I, "minimum": 0, "maximum": 100}, "wind_kph": _N})),
    ("recipe", "Give a pancake recipe as JSON.",
     _obj({"name": _S, "servings": _I, "ingredients": _arr(_obj({"item": _S, "amount": _S}), 1, 8),
           "steps": _arr(_S, 1, 6)})),
    ("book", "Describe a famous novel as JSON.",
     _obj({"title": _S, "author": _S, "year": {**_I, "minimum": 1000, "maximum": 2100}, "genres": _arr(_S, 1, 3),
           "isbn": {**_S, "pattern": "^[0-9-]{10,17}$"}})),
    ("movie_review", "Write a short review of a science-fiction film as JSON.",
     _obj({"movie": _S, "rating": {**_I, "minimum": 1, "maximum": 5}, "summary": {**_S, "maxLength": 200},
           "recommended": _B})),
    ("employee", "Create an employee record for a software engineer as JSON.",
     _obj({"employee_id": _I, "name": _S, "department": {"enum": ["engineering", "sales", "support", "finance"]},
           "manager": {"type": ["string", "null"]}, "start_date": {**_S, "format": "date"}, "salary": _N})),
    ("task_list", "List three chores for the weekend as JSON tasks.",
     _obj({"tasks": _arr(_obj({"title": _S, "done": _B, "priority": {"enum": ["low", "medium", "high"]}}), 1, 5)})),
    ("log_entry", "Write a web server log entry for a failed login as JSON.",
     _obj({"timestamp": {**_S, "format": "date-time"}, "level": {"enum": ["debug", "info", "warning", "error"]},
           "message": _S, "ip": _S, "status_code": {**_I, "minimum": 100, "maximum": 599}})),
    ("api_error", "Return an API error for a missing parameter as JSON.",
     _obj({"error": _obj({"code": _S, "message": _S, "field": {"type": ["string", "null"]}})})),
    ("geo_point", "Give the coordinates of the Eiffel Tower as JSON.",
     _obj({"name": _S, "lat": {**_N, "minimum": -90, "maximum": 90}, "lon": {**_N, "minimum": -180, "maximum": 180}})),
    ("flight", "Book a flight from Paris to Rome as JSON.",
     _obj({"flight_number": {**_S, "pattern": "^[A-Z]{2}[0-9]{2,4}$"}, "from": {**_S, "minLength": 3, "maxLength": 3},
           "to": {**_S, "minLength": 3, "maxLength": 3}, "departure": {**_S, "format": "date-time"},
           "passengers": _arr(_obj({"name": _S, "seat": _S}), 1, 3)})),
    ("restaurant", "Describe a small Italian restaurant as JSON.",
     _obj({"name": _S, "cuisine": _S, "price_range": {"enum": ["$", "$$", "$$$"]}, "rating": {**_N, "minimum": 0, "maximum": 5},
           "address": ADDRESS, "open_now": _B})),
    ("transaction", "Record a card payment at a grocery store as a JSON bank transaction.",
     _obj({"id": _S, "amount": _N, "currency": {"enum": ["USD", "EUR"]}, "merchant": _S,
           "category": {"enum": ["groceries", "transport", "dining", "other"]}, "pending": _B})),
    ("payment_method", "Give a payment method for an online shop as JSON.",
     {"oneOf": [_obj({"type": {"const": "card"}, "last4": {**_S, "pattern": "^[0-9]{4}$"}, "expiry": _S}),
                _obj({"type": {"const": "bank"}, "iban": _S, "holder": _S})]}),
    ("shape", "Describe a geometric shape as JSON.",
     {"oneOf": [_obj({"kind": {"const": "circle"}, "radius": _N}),
                _obj({"kind": {"const": "rectangle"}, "width": _N, "height": _N})]}),
    ("discount", "Give a discount for a spring sale as JSON.",
     _obj({"code": _S, "discount": {"oneOf": [{"type": "object", "properties": {"percent": {**_N, "minimum": 0, "maximum": 100}},
                                                "required": ["percent"]},
                                               {"type": "object", "properties": {"amount": {**_N, "minimum": 0}},
                                                "required": ["amount"]}]}})),
    ("package_manifest", "Write the manifest of a small JavaScript library as JSON.",
     _obj({"name": _S, "version": {**_S, "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"}, "description": _S, "license": _S,
           "dependencies": {"type": "object", "additionalProperties": _S}}, ["name", "version"])),
    ("service_config", "Give the configuration of a web service container as JSON.",
     _obj({"image": _S, "ports": _arr({**_I, "minimum": 1, "maximum": 65535}, 1, 4),
           "environment": {"type": "object", "additionalProperties": _S}, "restart": {"enum": ["no", "always", "on-failure"]}})),
    ("issue", "File a bug report about a crash on startup as JSON.",
     _obj({"title": _S, "body": _S, "labels": _arr({"enum": ["bug", "crash", "ui", "docs"]}, 1, 3),
           "severity": {"enum": ["low", "medium", "high", "critical"]}})),
    ("sensor", "Give three temperature readings from a greenhouse sensor as JSON.",
     _obj({"sensor_id": _S, "unit": {"enum": ["C", "F"]},
           "readings": _arr(_obj({"time": _S, "value": _N}), 1, 5)})),
    ("student_grades", "Give a student's grades in three subjects as JSON.",
     _obj({"student": _S, "grades": _arr(_obj({"subject": _S, "grade": {**_I, "minimum": 0, "maximum": 100}}), 1, 6),
           "passed": _B})),
    ("shopping_cart", "Show a shopping cart with fruit in it as JSON.",
     _obj({"cart_id": _S, "items": _arr(_obj({"name": _S, "qty": {**_I, "minimum": 1}, "price": _N}), 0, 6),
           "coupon": {"type": ["string", "null"]}})),
    ("sentiment", "Classify the sentiment of the sentence 'I love this phone' as JSON.",
     _obj({"label": {"enum": ["positive", "negative", "neutral"]}, "confidence": {**_N, "minimum": 0, "maximum": 1}})),
    ("entities", "Extract the people and places from 'Marie met Paul in Berlin' as JSON.",
     _obj({"people": _arr(_S), "places": _arr(_S)})),
]
