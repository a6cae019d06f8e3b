"""Gallery: every registered variant, its paper, its parameters, mask, block map and (score
mods) bias."""
from __future__ import annotations

import streamlit as st

from app import experiments, plots, services, ui
from app.services import gallery
from app.usercode import CodeProblem

st.title("Gallery")
lim = services.limits()
catalog = gallery.variant_catalog()

st.caption(f"{len(catalog)} variants. Pick one to see its mask and block map, tune its parameters, "
           "and open its source in the Playground.")
with st.expander("All variants", expanded=False):
    st.dataframe([{"name": v["name"], "title": v["title"], "kind": v["kind"],
                   "paper": v["link"]} for v in catalog], hide_index=True, width="stretch",
                 column_config={"paper": st.column_config.LinkColumn("paper")})

names = [v["name"] for v in catalog]
by_name = {v["name"]: v for v in catalog}
default = names.index("sliding_window") if "sliding_window" in names else 0
name = st.selectbox("Variant", names, index=default, key="gallery_variant",
                    format_func=lambda n: f"{by_name[n]['title']}  ·  {n}  [{by_name[n]['kind']}]")
entry = by_name[name]
variant = gallery.variant(name)

st.subheader(entry["title"])
st.write(entry["description"])
if entry["link"]:
    st.markdown(f"Reference: [{entry['reference']}]({entry['link']})")
else:
    st.markdown(f"Reference: {entry['reference']}")

controls, view_col = st.columns([1, 2], gap="large")
with controls:
    st.markdown("**Parameters**")
    params = ui.param_controls(variant, key_prefix=f"gallery_{name}")
    st.markdown("**Preview shape**")
    lens = [n for n in (64, 128, 256, 512, 1024, 2048, 4096) if n <= max(lim.max_len, 64)]
    q_len = st.select_slider("Q_LEN", lens, value=min(256, lens[-1]), key="gallery_q_len")
    heads = st.slider("heads", 1, 16 if not lim.cpu_mode else lim.max_bh, min(4, lim.max_bh),
                      key="gallery_heads")
    h = st.slider("show head h", 0, heads - 1, 0, key="gallery_h") if heads > 1 else 0
    block = st.selectbox("BLOCK_SIZE", lim.block_sizes, key="gallery_block",
                         index=ui.index_of(lim.block_sizes, 32 if lim.cpu_mode else 128))

with view_col:
    params_key = tuple(sorted(params.items()))
    try:
        view = gallery.gallery_view(name, params_key, q_len, heads, h, block)
    except services.ActionFailed as e:
        ui.show_failure(e)
        view = None
    if view is not None:
        m = view["mask"]
        st.plotly_chart(plots.mask_heatmap(m, f"Mask, head {h} (Q_LEN {view['Q_LEN']}, KV_LEN "
                                              f"{view['KV_LEN']})"), key="gallery_mask_fig",
                        width="stretch")
        st.caption(f"Kept {m['kept']:,} of {m['total']:,} positions "
                   f"({100 * m['kept'] / m['total']:.2f} %)."
                   + ("" if m["has_mask"] else " This variant has no mask_mod (score_mod only)."))
        if view["scores"] is not None:
            sv = view["scores"]
            st.plotly_chart(plots.value_heatmap(sv, f"Bias of the score_mod, head {h} "
                                                    "(score_mod of zero scores)", "bias"),
                            key="gallery_bias_fig", width="stretch")
            st.caption(f"Kept values range from {services.tables.fmt(sv['min'])} to "
                       f"{services.tables.fmt(sv['max'])}; masked positions are blank.")
        bl = view["blocks"]
        st.plotly_chart(plots.block_map(bl, f"Block map, head {h}: {bl['sparsity']:.1f} % of blocks "
                                            f"skipped"), key="gallery_block_fig", width="stretch")
        st.caption(f"full {bl['full']:,} · partial {bl['partial']:,} · empty {bl['empty']:,} "
                   "(over all heads)")

st.divider()
shape = {**services.default_shape(), **st.session_state.get(ui.SHAPE_KEY, {})}
st.markdown(f"**Source** at the Playground's shape (B={shape['B']}, H={shape['Hq']}, "
            f"Q_LEN={shape['Q_LEN']}, KV_LEN={shape['KV_LEN']}):")
try:
    source = gallery.variant_source(name, params, shape)
except Exception as e:  # noqa: BLE001 - a parameter setting the variant rejects
    ui.show_problem(CodeProblem("exception", type(e).__name__, str(e)))
    source = None
if source is not None:
    if st.button("Open in Playground", type="primary", icon=":material/open_in_new:",
                 key="gallery_open", help="A new experiment with this source"):
        settings = ", ".join(f"{k}={v}" for k, v in params.items())
        experiments.open_new(source, f"{name}({settings})", shape)
        st.switch_page("app_pages/playground.py",
                       query_params={"exp": experiments.current()["id"]})
    st.code(source, language="python")
