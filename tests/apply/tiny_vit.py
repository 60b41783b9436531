"""A tiny vision transformer written the way keras.io's ViT tutorial writes it: custom
layers that take their own arguments (no ``**kwargs``, no ``get_config``), so they cannot
be re-created from a config; apply trains it from its builder (``apply.wrap(build_model,
plan)``)."""
import keras
import numpy as np
from keras import layers, ops

IMAGE, PATCH, DIM, HEADS, CLASSES = 8, 4, 8, 2, 3
NUM_PATCHES = (IMAGE // PATCH) ** 2

loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
optimizer = keras.optimizers.Adam(learning_rate=1e-2)


class Patches(layers.Layer):
    def __init__(self, patch_size):
        super().__init__()
        self.patch_size = patch_size

    def call(self, images):
        patches = ops.image.extract_patches(images, size=self.patch_size)
        batch = ops.shape(patches)[0]
        return ops.reshape(patches, (batch, -1, self.patch_size * self.patch_size))


class PatchEncoder(layers.Layer):
    def __init__(self, num_patches, projection_dim):
        super().__init__()
        self.num_patches = num_patches
        self.projection = layers.Dense(units=projection_dim)
        self.position_embedding = layers.Embedding(input_dim=num_patches,
                                                   output_dim=projection_dim)

    def call(self, patch):
        positions = ops.expand_dims(ops.arange(start=0, stop=self.num_patches, step=1), axis=0)
        return self.projection(patch) + self.position_embedding(positions)


def build_model():
    images = keras.Input(shape=(IMAGE, IMAGE, 1), name="images")
    x = PatchEncoder(NUM_PATCHES, DIM)(Patches(PATCH)(images))
    a = layers.MultiHeadAttention(HEADS, DIM // HEADS, name="attention")(x, x)
    x = layers.LayerNormalization(name="ln_1")(layers.Add()([x, a]))
    h = layers.Dense(2 * DIM, activation="gelu", name="mlp_up")(x)
    h = layers.Dense(DIM, name="mlp_down")(h)
    x = layers.LayerNormalization(name="ln_2")(layers.Add()([x, h]))
    logits = layers.Dense(CLASSES, name="head")(layers.Flatten()(x))
    return keras.Model(images, logits, name="tiny_vit")


def sample_batch(batch_size):
    rng = np.random.default_rng(batch_size)
    x = rng.normal(size=(batch_size, IMAGE, IMAGE, 1)).astype("float32")
    y = (x[:, :4].mean(axis=(1, 2, 3)) > 0).astype("int32") + (x[:, 4:, :4].mean(
        axis=(1, 2, 3)) > 0).astype("int32")
    return x, y
