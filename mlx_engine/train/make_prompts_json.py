"""Write schema-extraction prompts for training a drafter on JSON answers (programmatic, written here).

    python -m mlx_engine.train.make_prompts_json   # -> mlx_engine/train/data/prompts_json_train.jsonl, prompts_json_eval.jsonl

Rows have the bench's json-suite form (`messages` + `response_format`), so `mlx_engine.train.make_corpus_json`
answers them under their grammar exactly as `python -m mlx_engine.bench --suite json` asks. Each row is one
record of a genre (a parcel notice, a library loan, a trail description, ...) drawn from small value lists and
written out as a paragraph; the schema asks for its fields (strings, integers, numbers, enums, booleans,
arrays, nested objects, nulls). None of the genres is one of bench/prompts/json.jsonl's (that suite is not
read), and the held-out file uses genres of its own.
"""

import json
import random
from pathlib import Path

DATA = Path(__file__).parent / "data"

FIRST = ["Amara", "Tomasz", "Leila", "Kenji", "Rosa", "Idris", "Freya", "Mateo", "Ngozi", "Elias", "Sunita",
         "Pavel", "Ines", "Callum", "Yara", "Hugo", "Mei", "Oskar", "Zanele", "Rafael", "Ayla", "Bruno"]
LAST = ["Okafor", "Lindqvist", "Haddad", "Moreau", "Tanaka", "Brennan", "Silva", "Kowalczyk", "Adeyemi", "Novak",
        "Castellano", "Fitzgerald", "Rahman", "Jensen", "Duarte", "Whitaker", "Petrova", "Mensah", "Aalto"]
CITIES = ["Leeds", "Utrecht", "Porto", "Gdansk", "Aarhus", "Lyon", "Bilbao", "Graz", "Tampere", "Cork",
          "Brno", "Ghent", "Bologna", "Malmo", "Basel", "Nantes", "Bristol", "Turku", "Krakow", "Dundee"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
SYSTEMS = ["You extract structured data from text. Reply with a single JSON object and nothing else.",
           "You turn text into JSON records. Answer with one JSON object only.",
           "You are a data-entry assistant. Output only JSON."]


def person(r):
    return f"{r.choice(FIRST)} {r.choice(LAST)}"


def date(r, year=None):
    return f"{r.randint(1, 28)} {r.choice(MONTHS)} {year or r.randint(2023, 2026)}"


def iso(r):
    return f"{r.randint(2023, 2026)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"


def obj(props, required=None):
    return {"type": "object", "properties": props, "required": required or list(props), "additionalProperties": False}


# bounded, as real schemas are (and bench/prompts/json.jsonl's): an unbounded string or array lets a small model
# loop until --max-tokens
S, I, N, B = {"type": "string", "maxLength": 60}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def arr(item, **kw):
    return {"type": "array", "items": item, "maxItems": 6, **kw}


def enum(*xs):
    return {"type": "string", "enum": list(xs)}


def parcel(r):
    carrier = r.choice(["SwiftPost", "Parcelwing", "Northline Express", "BlueCrate"])
    n, status = r.randint(1, 4), r.choice(["in transit", "out for delivery", "delayed", "delivered"])
    code = f"{r.choice('ABCDEFGH')}{r.choice('JKLMNPQR')}{r.randint(100000000, 999999999)}"
    kg = round(r.uniform(0.3, 18), 1)
    text = (f"Your {carrier} shipment {code} ({n} package{'s' if n > 1 else ''}, {kg} kg) is {status}. It left our "
            f"{r.choice(CITIES)} depot on {date(r)} and is addressed to {person(r)} in {r.choice(CITIES)}. "
            f"{'A signature is required on delivery.' if r.random() < .5 else 'No signature is needed.'}")
    schema = obj({"carrier": S, "tracking_code": S, "packages": I, "weight_kg": N,
                  "status": enum("in transit", "out for delivery", "delayed", "delivered"), "origin_depot": S,
                  "recipient": S, "destination_city": S, "signature_required": B})
    return "Extract the shipment details as JSON.", text, schema


def library_loan(r):
    books = r.sample(["The Glass Orchard", "A Short History of Rain", "Field Notes on Moss", "The Ninth Lantern",
                      "Counting Sheep in Iceland", "Bridges of Salt", "The Weaver's Almanac", "Quiet Engines"],
                     r.randint(1, 3))
    fine = r.choice([0, 0, 0.5, 1.2, 2.75])
    text = (f"{r.choice(CITIES)} Central Library, loan receipt. Member: {person(r)} (card {r.randint(10000, 99999)}). "
            f"Items: {', '.join(books)}. Due back on {date(r)}. "
            + (f"Outstanding fines: {fine:.2f} EUR." if fine else "No outstanding fines."))
    schema = obj({"library": S, "member": S, "card_number": I, "items": arr(S, minItems=1), "due_date": S,
                  "fines_eur": N})
    return "Turn this loan receipt into JSON.", text, schema


def trail(r):
    name = r.choice(["Ridge", "Falls", "Heron", "Old Quarry", "Beacon", "Larchwood"]) + " " + r.choice(["Loop", "Trail", "Path", "Way"])
    km, climb = round(r.uniform(3, 24), 1), r.randint(50, 1200)
    grade = r.choice(["easy", "moderate", "hard"])
    dogs = r.random() < .6
    feats = r.sample(["a waterfall", "a ruined chapel", "pine forest", "a lake shore", "a summit cairn",
                      "a footbridge", "wild orchids"], r.randint(1, 3))
    text = (f"The {name} near {r.choice(CITIES)} is a {km} km {grade} walk with {climb} m of climbing. Along the way "
            f"you pass {', '.join(feats)}. Allow about {r.randint(1, 7)} hours. "
            f"{'Dogs are welcome on a lead.' if dogs else 'Dogs are not allowed.'}")
    schema = obj({"name": S, "near": S, "distance_km": N, "ascent_m": I, "difficulty": enum("easy", "moderate", "hard"),
                  "highlights": arr(S), "hours": I, "dogs_allowed": B})
    return "Describe this trail as JSON.", text, schema


def podcast(r):
    show = r.choice(["Night Shift Science", "The Tidy Kitchen", "Two Cents on Trains", "Small Print", "Deep Soil"])
    ep, mins = r.randint(1, 240), r.randint(18, 95)
    guests = [person(r) for _ in range(r.randint(0, 2))]
    topic = r.choice(["how lighthouses were automated", "why bread goes stale", "the economics of ferries",
                      "restoring old pianos", "tracking migrating eels", "the history of tinned fish"])
    text = (f"Episode {ep} of {show}: this week we look at {topic}. Runtime {mins} minutes. "
            + (f"Guests: {' and '.join(guests)}. " if guests else "No guests this week. ")
            + f"Released {date(r)}.{' Contains explicit language.' if r.random() < .2 else ''}")
    schema = obj({"show": S, "episode": I, "topic": S, "minutes": I, "guests": arr(S), "released": S, "explicit": B})
    return "Extract the episode details as JSON.", text, schema


def laptop(r):
    brand = r.choice(["Corvel", "Ashmark", "Lumenta", "Kestrel"])
    model = f"{brand} {r.choice(['Air', 'Pro', 'Book', 'Slate'])} {r.randint(13, 16)}"
    ram, ssd = r.choice([8, 16, 32, 64]), r.choice([256, 512, 1024, 2048])
    weight = round(r.uniform(0.9, 2.4), 2)
    ports = r.sample(["USB-C", "USB-A", "HDMI", "SD card", "headphone jack", "Ethernet"], r.randint(2, 4))
    text = (f"{model}: {ram} GB of RAM, {ssd} GB SSD, {r.choice(['13.3', '14', '15.6', '16'])}-inch display, "
            f"weighs {weight} kg. Ports: {', '.join(ports)}. Battery rated at {r.randint(6, 22)} hours. "
            f"Price {r.randint(499, 2899)} GBP.")
    schema = obj({"model": S, "brand": S, "ram_gb": I, "storage_gb": I, "weight_kg": N, "ports": arr(S),
                  "battery_hours": I, "price": obj({"amount": N, "currency": enum("USD", "EUR", "GBP")})})
    return "Extract the laptop's specification as JSON.", text, schema


def adoption(r):
    kind = r.choice(["dog", "cat", "rabbit", "guinea pig"])
    name = r.choice(["Biscuit", "Juniper", "Pepper", "Otto", "Marlowe", "Fig", "Clementine", "Rolo"])
    age, sex = r.randint(1, 12), r.choice(["male", "female"])
    kids, pets = r.random() < .6, r.random() < .5
    text = (f"Meet {name}, a {age}-year-old {sex} {kind} at the {r.choice(CITIES)} rescue centre. {name} is "
            f"{r.choice(['shy at first but very affectionate', 'playful and curious', 'calm and gentle', 'full of energy'])}. "
            f"{'Good with children.' if kids else 'Best in a home without young children.'} "
            f"{'Lives happily with other animals.' if pets else 'Needs to be the only pet.'} "
            f"Adoption fee: {r.choice([45, 60, 95, 150])} GBP.")
    schema = obj({"name": S, "species": enum("dog", "cat", "rabbit", "guinea pig"), "age_years": I,
                  "sex": enum("male", "female"), "temperament": S, "good_with_children": B, "good_with_pets": B,
                  "fee_gbp": I})
    return "Turn this adoption listing into a JSON record.", text, schema


def repair(r):
    item = r.choice(["road bike", "e-scooter", "washing machine", "coffee grinder", "vacuum cleaner"])
    ref = f"R-{r.randint(1000, 9999)}"
    parts = r.sample(["brake pads", "a drive belt", "a fuse", "the chain", "a seal kit", "the motor brushes",
                      "a new switch"], r.randint(1, 3))
    labour, total = r.randint(20, 90), r.randint(30, 240)
    text = (f"Repair order {ref}. Customer {person(r)} brought in a {item} on {date(r)}: "
            f"{r.choice(['makes a grinding noise', 'will not start', 'stops after a few minutes', 'leaks'])}. "
            f"We replaced {', '.join(parts)}. Labour {labour} minutes, total {total} EUR. "
            f"{'Paid in full.' if r.random() < .7 else 'Payment due on collection.'}")
    schema = obj({"reference": S, "customer": S, "item": S, "fault": S, "parts_replaced": arr(S),
                  "labour_minutes": I, "total_eur": N, "paid": B})
    return "Extract the repair order as JSON.", text, schema


def exhibition(r):
    title = r.choice(["Salt and Silver", "The Map Room", "Tides of Glass", "Paper Cities", "Small Machines"])
    venue = f"{r.choice(CITIES)} {r.choice(['Museum of Art', 'Gallery', 'Design Museum', 'Maritime Museum'])}"
    price = r.choice([0, 6, 8.5, 12, 15])
    artists = [person(r) for _ in range(r.randint(1, 3))]
    text = (f"{title}, at the {venue} from {date(r, 2025)} to {date(r, 2026)}. Work by {', '.join(artists)}. "
            + ("Free entry." if not price else f"Tickets {price} EUR, under-12s free.")
            + f" Open {r.choice(['Tuesday to Sunday', 'every day', 'Wednesday to Sunday'])}.")
    schema = obj({"title": S, "venue": S, "opens": S, "closes": S, "artists": arr(S, minItems=1),
                  "ticket_eur": {"type": ["number", "null"]}, "open_days": S})
    return "Extract the exhibition listing as JSON. Use null for the ticket price when entry is free.", text, schema


def sighting(r):
    bird = r.choice(["kingfisher", "red kite", "little egret", "barn owl", "waxwing", "osprey", "goldcrest"])
    n = r.randint(1, 30)
    text = (f"Sighting log, {iso(r)} at {r.randint(5, 20):02d}:{r.choice(['05', '20', '35', '50'])}: {n} {bird}"
            f"{'s' if n > 1 else ''} at {r.choice(['the reservoir', 'Marsh Lane hide', 'the estuary', 'the old gravel pits'])}"
            f" near {r.choice(CITIES)}. Observer: {person(r)}. Weather {r.choice(['clear', 'overcast', 'light rain', 'foggy'])}."
            f"{' Photographed.' if r.random() < .4 else ''}")
    schema = obj({"date": {"type": "string", "format": "date"}, "time": S, "species": S, "count": I, "site": S,
                  "observer": S, "weather": enum("clear", "overcast", "light rain", "foggy"), "photo": B})
    return "Record this bird sighting as JSON.", text, schema


def course(r):
    code = f"{r.choice(['CS', 'BIO', 'HIS', 'ECO', 'MAT'])}{r.randint(100, 499)}"
    title = r.choice(["Data Structures", "Cell Biology", "Medieval Trade Routes", "Game Theory", "Linear Algebra"])
    credits, seats = r.randint(2, 10), r.randint(12, 180)
    days = r.sample(["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"], r.randint(1, 3))
    text = (f"{code} {title}, taught by Dr {person(r)}. {credits} credits. Lectures on {' and '.join(days)} at "
            f"{r.randint(8, 17)}:00 in room {r.choice('ABCDE')}{r.randint(1, 4)}{r.randint(10, 40)}. {seats} seats. "
            f"{'Prerequisite: ' + r.choice(['CS101', 'MAT110', 'BIO120']) + '.' if r.random() < .6 else 'No prerequisites.'}")
    schema = obj({"code": S, "title": S, "lecturer": S, "credits": I, "days": arr(S, minItems=1), "room": S,
                  "seats": I, "prerequisite": {"type": ["string", "null"], "maxLength": 20}})
    return "Extract the course entry as JSON. Use null when there is no prerequisite.", text, schema


def claim(r):
    kind = r.choice(["water damage", "a stolen bicycle", "a cracked windscreen", "storm damage to a fence"])
    amount = r.randint(90, 4800)
    text = (f"Claim {r.randint(100000, 999999)} filed by {person(r)} on {date(r)} for {kind}. Policy "
            f"{r.choice(['HOME', 'AUTO', 'CYC'])}-{r.randint(1000, 9999)}. Amount claimed: {amount} GBP. "
            f"{'Photos attached.' if r.random() < .6 else 'No photos yet.'} Status: "
            f"{r.choice(['received', 'under review', 'approved', 'rejected'])}.")
    schema = obj({"claim_number": I, "claimant": S, "filed": S, "incident": S, "policy": S, "amount_gbp": N,
                  "photos": B, "status": enum("received", "under review", "approved", "rejected")})
    return "Convert this insurance claim into JSON.", text, schema


def stock_item(r):
    sku = f"{r.choice(['WH', 'TL', 'GD'])}-{r.randint(10000, 99999)}"
    name = r.choice(["cordless drill", "garden hose 25 m", "LED work lamp", "socket set", "pruning shears"])
    qty, low = r.randint(0, 400), r.randint(5, 40)
    text = (f"Stock record {sku}: {name}, aisle {r.randint(1, 30)}, shelf {r.choice('ABCDEF')}. On hand: {qty}. "
            f"Reorder level: {low}. Supplier: {r.choice(['Hartwell Tools', 'Greenfield Supply', 'Kobalt Trading'])}. "
            f"Unit cost {round(r.uniform(2, 180), 2)} EUR.")
    schema = obj({"sku": S, "name": S, "aisle": I, "shelf": S, "on_hand": I, "reorder_level": I, "supplier": S,
                  "unit_cost_eur": N})
    return "Extract the stock record as JSON.", text, schema


def volunteer(r):
    task = r.choice(["food bank sorting", "beach clean-up", "park tree planting", "library reading hour"])
    people = [person(r) for _ in range(r.randint(1, 4))]
    text = (f"Volunteer rota for {task} on {date(r)}, {r.randint(8, 14)}:00 to {r.randint(15, 19)}:00 at "
            f"{r.choice(CITIES)} {r.choice(['community hall', 'harbour', 'north park', 'town library'])}. "
            f"Signed up: {', '.join(people)}. Coordinator: {person(r)}."
            f"{' Lunch provided.' if r.random() < .5 else ''}")
    schema = obj({"task": S, "date": S, "start": S, "end": S, "place": S, "volunteers": arr(S), "coordinator": S,
                  "lunch_provided": B})
    return "Turn this rota into a JSON record.", text, schema


def game(r):
    name = r.choice(["Harbourmasters", "Lichen", "Night Train to Orla", "Copper & Coal", "The Quiet Forest"])
    lo, hi = r.randint(1, 2), r.randint(4, 6)
    text = (f"{name} is a {r.choice(['cooperative', 'competitive', 'deck-building', 'tile-laying'])} board game for "
            f"{lo} to {hi} players aged {r.choice([8, 10, 12, 14])}+, designed by {person(r)} and published by "
            f"{r.choice(['Fernway Games', 'Bright Owl', 'Tallship Press'])} in {r.randint(2012, 2025)}. A game takes "
            f"about {r.choice([20, 30, 45, 60, 90])} minutes.")
    schema = obj({"name": S, "style": enum("cooperative", "competitive", "deck-building", "tile-laying"),
                  "players": obj({"min": I, "max": I}), "min_age": I, "designer": S, "publisher": S, "year": I,
                  "minutes": I})
    return "Describe this board game as JSON.", text, schema


def json_object(r):
    """A json_object row: the keys asked for in words (as bench rows json-006/012/018/022 do, other genres)."""
    kind = r.choice(["hotel", "gym"])
    if kind == "hotel":
        nights = r.randint(1, 9)
        text = (f"Reservation for {person(r)} at Hotel {r.choice(['Aurora', 'Kestrel', 'Bellwether'])}, "
                f"{r.choice(CITIES)}: {nights} night{'s' if nights > 1 else ''} from {date(r)}, "
                f"{r.choice(['single', 'double', 'twin', 'family'])} room, breakfast "
                f"{'included' if r.random() < .5 else 'not included'}. Total {r.randint(80, 1400)} EUR.")
        ask = ("Return a JSON object for this reservation with the keys guest, hotel, city, nights, check_in, "
               "room_type, breakfast (true or false) and total_eur.")
    else:
        classes = r.sample(["spin", "pilates", "boxing", "yoga", "rowing", "circuits"], r.randint(1, 3))
        text = (f"Welcome to {r.choice(CITIES)} Fitness, {person(r)}! Your {r.choice(['monthly', 'annual'])} "
                f"membership starts on {date(r)}. Included classes: {', '.join(classes)}. Locker number "
                f"{r.randint(1, 300)}. Fee {r.choice([29, 39, 45, 420])} GBP.")
        ask = ("Return a JSON object for this membership with the keys member, gym, plan, start_date, classes "
               "(a list), locker and fee_gbp.")
    return ask, text, None


TRAIN_GENRES = [parcel, library_loan, trail, podcast, laptop, adoption, repair, exhibition, sighting, course,
                claim, stock_item, volunteer, json_object]
EVAL_GENRES = [game]  # held out: a genre no training row has


def row(r, genre, i, prefix):
    ask, text, schema = genre(r)
    fmt = ({"type": "json_schema", "json_schema": {"name": genre.__name__, "strict": True, "schema": schema}}
           if schema else {"type": "json_object"})
    return {"id": f"{prefix}-{i:04d}", "messages": [{"role": "system", "content": r.choice(SYSTEMS)},
                                                    {"role": "user", "content": f"{ask}\n\n{text}"}],
            "response_format": fmt}


def main() -> None:
    r = random.Random(2026)
    train = [row(r, TRAIN_GENRES[i % len(TRAIN_GENRES)], i, "jtrain") for i in range(420)]
    held = [row(r, g, i, "jeval") for i, g in enumerate(EVAL_GENRES * 12)]
    for name, rows in (("prompts_json_train.jsonl", train), ("prompts_json_eval.jsonl", held)):
        with open(DATA / name, "w") as f:
            f.writelines(json.dumps(x) + "\n" for x in rows)
        print(f"{DATA / name}: {len(rows)} rows")


if __name__ == "__main__":
    main()
