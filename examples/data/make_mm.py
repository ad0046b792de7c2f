"""Rebuild the small multimodal example set in examples/data/mm/ (well under 1 MB).

    python examples/data/make_mm.py [OUT_DIR]      # default: mm/ beside this script

Writes:
- 12 PNG images, 64x64, one coloured shape on white: ``{red,green,blue,yellow}_{circle,square,triangle}.png``;
- ``clip.mp4``: 16 frames at 8 fps, 64x64, a red square moving left to right (H.264 through PyAV);
- ``tone.wav``: 1 s of a 440 Hz sine at 16 kHz, 16-bit PCM (soundfile);
- three training files in ms-swift's row forms, media paths relative to the data file:
  ``gme_train.jsonl`` (query form, as GME's docs write it), ``qwen3_vl_train.jsonl``
  (messages form, ms-swift >= 3.9) and ``audio_train.jsonl`` (``<audio>`` rows, both forms).

The rows cover image->text, text->image, two images in one member, the video, 0, 1 and 2
hard negatives, and text-only rows, so one file exercises every path of the reader and
the media loaders. ``mmembed.data.read_file(path)`` reads each file.
"""

import json
import os
import sys

import av
import numpy as np
import soundfile as sf
from PIL import Image, ImageDraw

SIZE = 64
COLORS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220), "yellow": (240, 200, 20)}
SHAPES = ("circle", "square", "triangle")


def draw_shape(color, shape):
    im = Image.new("RGB", (SIZE, SIZE), "white")
    d = ImageDraw.Draw(im)
    box = (12, 12, SIZE - 12, SIZE - 12)
    if shape == "circle":
        d.ellipse(box, fill=color)
    elif shape == "square":
        d.rectangle(box, fill=color)
    else:
        d.polygon([(SIZE // 2, 10), (SIZE - 10, SIZE - 12), (10, SIZE - 12)], fill=color)
    return im


def write_images(out):
    for cname, rgb in COLORS.items():
        for shape in SHAPES:
            draw_shape(rgb, shape).save(os.path.join(out, f"{cname}_{shape}.png"), optimize=True)


def write_clip(path, frames=16, fps=8):
    """A red square sliding from left to right over a white background."""
    with av.open(path, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width = stream.height = SIZE
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "18", "preset": "medium", "threads": "1"}
        for i in range(frames):
            a = np.full((SIZE, SIZE, 3), 255, np.uint8)
            x = 4 + i * 2
            a[24:40, x : x + 16] = COLORS["red"]
            for packet in stream.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def write_tone(path, rate=16000, seconds=1.0, hz=440.0):
    t = np.arange(int(rate * seconds)) / rate
    sf.write(path, (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32), rate, subtype="PCM_16")


def user(content):
    return [{"role": "user", "content": content}]


GME_ROWS = [
    # image -> text, 1 negative (the row GME's docs show)
    {"query": "<image>", "response": "a red circle", "rejected_response": ["a blue square"], "images": ["red_circle.png"]},
    # image -> text, 0 negatives (key absent) and an empty list
    {"query": "<image>", "response": "a green triangle", "images": ["green_triangle.png"]},
    {"query": "<image>", "response": "a yellow square", "rejected_response": [], "images": ["yellow_square.png"]},
    # image -> text, 2 negatives
    {
        "query": "<image>",
        "response": "a blue circle",
        "rejected_response": ["a blue square", "a red circle"],
        "images": ["blue_circle.png"],
    },
    # image + instruction -> text
    {
        "query": "<image>What colour is this shape?",
        "response": "green",
        "rejected_response": ["red"],
        "images": ["green_square.png"],
    },
    # text -> image, 0, 1 and 2 image negatives (images bind query, response, then negatives)
    {"query": "a red triangle", "response": "<image>", "images": ["red_triangle.png"]},
    {
        "query": "a yellow circle",
        "response": "<image>",
        "rejected_response": ["<image>"],
        "images": ["yellow_circle.png", "yellow_triangle.png"],
    },
    {
        "query": "a blue square",
        "response": "<image>",
        "rejected_response": ["<image>", "<image>"],
        "images": ["blue_square.png", "blue_circle.png", "red_square.png"],
    },
    # image -> image
    {
        "query": "<image>Find another shape of the same colour.",
        "response": "<image>",
        "rejected_response": ["<image>"],
        "images": ["red_circle.png", "red_square.png", "green_circle.png"],
    },
    # two images in one member
    {
        "query": "<image><image>",
        "response": "two red shapes: a circle and a square",
        "rejected_response": ["two blue shapes"],
        "images": ["red_circle.png", "red_square.png"],
    },
    {
        "query": "a green circle next to a green triangle",
        "response": "<image> <image>",
        "images": ["green_circle.png", "green_triangle.png"],
    },
    # video -> text and text -> video
    {
        "query": "<video>",
        "response": "a red square moving from left to right",
        "rejected_response": ["a blue circle standing still"],
        "videos": ["clip.mp4"],
    },
    {"query": "a square sliding across the frame", "response": "<video>", "videos": ["clip.mp4"]},
    # text only
    {"query": "a shape with three corners", "response": "a triangle", "rejected_response": ["a circle"]},
    {"query": "a shape with no corners", "response": "a circle"},
    {
        "query": "the colour of the sky on a clear day",
        "response": "blue",
        "rejected_response": ["yellow", "green"],
    },
]

QWEN3_VL_ROWS = [
    # image -> text, 1 negative
    {
        "messages": user("<image>"),
        "images": ["red_circle.png"],
        "positive_messages": [user("a red circle")],
        "negative_messages": [user("a blue square")],
    },
    # image -> text, 0 negatives
    {"messages": user("<image>"), "images": ["green_triangle.png"], "positive_messages": [user("a green triangle")]},
    # image -> text, 2 negatives, with a system message
    {
        "messages": [{"role": "system", "content": "Represent the shape for retrieval."}] + user("<image>"),
        "images": ["blue_circle.png"],
        "positive_messages": [user("a blue circle")],
        "negative_messages": [user("a blue square"), user("a red circle")],
    },
    # text -> image, 0, 1 and 2 image negatives (each group has its own image list)
    {
        "messages": user("a red triangle"),
        "positive_messages": [user("<image>")],
        "positive_images": [["red_triangle.png"]],
    },
    {
        "messages": user("a yellow circle"),
        "positive_messages": [user("<image>")],
        "positive_images": [["yellow_circle.png"]],
        "negative_messages": [user("<image>")],
        "negative_images": [["yellow_triangle.png"]],
    },
    {
        "messages": user("a blue square"),
        "positive_messages": [user("<image>")],
        "positive_images": [["blue_square.png"]],
        "negative_messages": [user("<image>"), user("<image>")],
        "negative_images": [["blue_circle.png"], ["red_square.png"]],
    },
    # OpenAI-style content parts carry their own paths
    {
        "messages": user([{"type": "image", "image": "green_square.png"}, {"type": "text", "text": "What colour?"}]),
        "positive_messages": [user("green")],
        "negative_messages": [user("red")],
    },
    {
        "messages": user("a yellow square"),
        "positive_messages": [user([{"type": "image", "image": "yellow_square.png"}])],
        "negative_messages": [user([{"type": "image", "image": "green_square.png"}])],
    },
    # image -> image
    {
        "messages": user("<image>Find another shape of the same colour."),
        "images": ["red_circle.png"],
        "positive_messages": [user("<image>")],
        "positive_images": [["red_square.png"]],
        "negative_messages": [user("<image>")],
        "negative_images": [["green_circle.png"]],
    },
    # two images in one group
    {
        "messages": user("<image><image>"),
        "images": ["red_circle.png", "red_square.png"],
        "positive_messages": [user("two red shapes: a circle and a square")],
        "negative_messages": [user("two blue shapes")],
    },
    {
        "messages": user("a green circle next to a green triangle"),
        "positive_messages": [user("<image> <image>")],
        "positive_images": [["green_circle.png", "green_triangle.png"]],
    },
    # video -> text and text -> video
    {
        "messages": user("<video>"),
        "videos": ["clip.mp4"],
        "positive_messages": [user("a red square moving from left to right")],
        "negative_messages": [user("a blue circle standing still")],
    },
    {
        "messages": user("a square sliding across the frame"),
        "positive_messages": [user("<video>")],
        "positive_videos": [["clip.mp4"]],
    },
    # text only
    {
        "messages": user("a shape with three corners"),
        "positive_messages": [user("a triangle")],
        "negative_messages": [user("a circle")],
    },
    {"messages": user("a shape with no corners"), "positive_messages": [user("a circle")]},
    {
        "messages": user("the colour of the sky on a clear day"),
        "positive_messages": [user("blue")],
        "negative_messages": [user("yellow"), user("green")],
    },
]

AUDIO_ROWS = [
    {
        "query": "<audio>",
        "response": "a steady 440 Hz tone",
        "rejected_response": ["a dog barking"],
        "audios": ["tone.wav"],
    },
    {"query": "a pure beep", "response": "<audio>", "audios": ["tone.wav"]},
    {"query": "<audio>What note is this?", "response": "A4", "rejected_response": ["C4", "G4"], "audios": ["tone.wav"]},
    {
        "messages": user("<audio>"),
        "audios": ["tone.wav"],
        "positive_messages": [user("a sine wave")],
        "negative_messages": [user("white noise")],
    },
]


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(out):
    os.makedirs(out, exist_ok=True)
    write_images(out)
    write_clip(os.path.join(out, "clip.mp4"))
    write_tone(os.path.join(out, "tone.wav"))
    write_jsonl(os.path.join(out, "gme_train.jsonl"), GME_ROWS)
    write_jsonl(os.path.join(out, "qwen3_vl_train.jsonl"), QWEN3_VL_ROWS)
    write_jsonl(os.path.join(out, "audio_train.jsonl"), AUDIO_ROWS)
    total = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))
    print(f"wrote {len(os.listdir(out))} files, {total} bytes, to {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "mm"))
