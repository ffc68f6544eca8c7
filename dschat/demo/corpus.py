"""Embedded demo data: an e-commerce customer-service preference corpus, generated, never downloaded.

Three row kinds, all in the formats of docs/data.md, Row formats:

- ``generate_pairwise``: rm-static style rows ``{"prompt", "response", "chosen", "rejected"}`` with
  ``prompt = "\\n\\nHuman: <question>\\n\\nAssistant:"`` and answers that start with a space, as in
  ``Dahoas/rm-static``. About 80% Chinese, 20% English. The chosen answer apologises or acknowledges, then names a
  concrete step with the order number and/or a time frame; the rejected one is curt, evasive or states a wrong
  policy.
  The contrast is deliberately stylistic so that a 2-4 layer Llama reward model separates it (>= 95% pairwise
  accuracy) and SFT on ``chosen`` visibly moves a tiny model towards it.
- ``generate_prompts``: prompt-only rows with a checkable integer ``answer`` (order totals, discounts, refunds)
  for GRPO rule rewards; the expected completion is ``<think>...</think><answer>42</answer>``.
- ``generate_judge_pairs``: RM-R1 judge rows (``context_messages`` + ``winner``) built from pairwise rows, with
  the good answer placed in A or B exactly half of the time.

Everything is a pure function of ``(n, seed)``: each generator owns a ``random.Random`` seeded from a string
that names the stream, so the three files do not share draws and adding a row kind never shifts another's
output. Python seeds ``random.Random`` from a ``str`` through SHA-512, which does not depend on
``PYTHONHASHSEED``. Pure stdlib on purpose: ``import dschat.demo.corpus`` must stay cheap (no torch or
transformers). The text the library shares with the demo (turn markers, tags, the judge's task and rubrics)
lives in ``dschat.prompts``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dschat.prompts import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    ASSISTANT_SUFFIX,
    EN_RUBRIC,
    HUMAN_PREFIX,
    THINK_CLOSE,
    THINK_OPEN,
    ZH_RUBRIC,
    is_english,
    judge_user_message,
)
from dschat.utils import write_jsonl

DEFAULT_PAIRWISE_ROWS = 3200
DEFAULT_PROMPT_ROWS = 1000
DEFAULT_JUDGE_ROWS = 1000


def format_prompt(question: str) -> str:
    """rm-static prompt for one user turn: ``"\\n\\nHuman: <question>\\n\\nAssistant:"``."""
    return f"{HUMAN_PREFIX}{question}{ASSISTANT_SUFFIX}"


def prompt_question(prompt: str) -> str:
    """Inverse of ``format_prompt``: the bare question of a one-turn rm-static prompt."""
    if not (prompt.startswith(HUMAN_PREFIX) and prompt.endswith(ASSISTANT_SUFFIX)):
        raise ValueError(f"not a one-turn rm-static prompt: {prompt!r}")
    return prompt[len(HUMAN_PREFIX) : -len(ASSISTANT_SUFFIX)]


def _stream(kind: str, seed: int) -> random.Random:
    # One named stream per row kind (see module docstring).
    return random.Random(f"dschat.demo/{kind}/{seed}")


# --------------------------------------------------------------------------------------------------------------
# Slot fillers
# --------------------------------------------------------------------------------------------------------------


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_ZH_PRODUCTS = _words(
    "蓝牙耳机 保温杯 羽绒服 运动鞋 机械键盘 电饭煲 空气炸锅 扫地机器人 "
    "儿童书包 护肤套装 台灯 行李箱 充电宝 手机壳 毛衣 牛仔裤 连衣裙 茶叶礼盒 "
    "猫粮 婴儿推车 路由器 电动牙刷 吹风机 智能手表 四件套 瑜伽垫 咖啡机 "
    "显示器 无线鼠标 登山包 平板电脑 加湿器 不粘锅 坚果礼盒 羊毛围巾 投影仪 "
    "保鲜盒 电热毯 儿童积木 洗衣凝珠 香水 口红 太阳镜 雨伞 卫衣 衬衫 "
    "羽毛球拍 蓝牙音箱 剃须刀 榨汁机 微波炉 电风扇 办公椅 收纳箱 花瓶 钢笔 "
    "狗粮 奶粉 面膜 床垫"
)
_ZH_CLOTHES = _words("T恤 牛仔裤 羽绒服 连衣裙 卫衣 衬衫 外套 短裤 毛衣 西装 运动裤")
_ZH_SHOES = ("运动鞋", "皮鞋", "板鞋", "靴子", "凉鞋")
_LETTER_SIZES = ("XS", "S", "M", "L", "XL", "XXL")
_ZH_CITIES = _words(
    "北京 上海 广州 深圳 杭州 成都 武汉 南京 西安 重庆 天津 苏州 长沙 "
    "郑州 青岛 沈阳 大连 厦门 福州 昆明 合肥 济南 哈尔滨 长春 南昌 贵阳 "
    "南宁 兰州 太原 石家庄 宁波 无锡 佛山 东莞 珠海 温州 海口"
)
_ZH_ROADS = _words("人民 解放 中山 建设 和平 长江 黄河 新华 文化 光明 青年 友谊")
_ZH_COURIERS = _words("顺丰 中通 圆通 韵达 申通 京东物流 邮政 极兔")
_ZH_PAYMENTS = _words("微信支付 支付宝 银行卡 信用卡 花呗 云闪付")
_ZH_PAY_ERRORS = _words("支付失败 网络超时 订单异常 系统繁忙 银行处理中")
_ZH_DAMAGE = _words("屏幕碎了 外壳裂了 包装压坏了 少了配件 有明显划痕 漏液了 按键失灵 无法开机 表面有污渍 断成两截")
_ZH_COLORS = _words("黑色 白色 红色 蓝色 灰色 粉色 绿色 米色 藏青色 卡其色")
_ZH_COMPANIES = _words("星辰 启航 云帆 瑞丰 华美 博远 新锐 恒通 嘉禾 远景")
_ZH_ETAS = ("24小时", "48小时", "2天", "3天", "1-2天", "2-3个工作日", "3个工作日")
_ZH_GREETINGS = ("", "", "", "你好，", "您好，", "在吗？", "客服，", "麻烦问下，", "急！", "亲，")

_EN_PRODUCTS = (
    "headphones",
    "water bottle",
    "winter jacket",
    "running shoes",
    "keyboard",
    "rice cooker",
    "air fryer",
    "robot vacuum",
    "backpack",
    "desk lamp",
    "suitcase",
    "power bank",
    "phone case",
    "sweater",
    "jeans",
    "dress",
    "tea set",
    "cat food",
    "stroller",
    "router",
    "electric toothbrush",
    "hair dryer",
    "smartwatch",
    "yoga mat",
    "coffee maker",
    "monitor",
    "wireless mouse",
    "tablet",
    "humidifier",
    "frying pan",
    "scarf",
    "projector",
    "blender",
    "office chair",
    "umbrella",
    "sunglasses",
    "speaker",
    "perfume",
)
_EN_CLOTHES = ("T-shirt", "jeans", "jacket", "dress", "hoodie", "shirt", "coat", "shorts", "sweater")
_EN_CITIES = _words(
    "Chicago Seattle Denver Austin Boston Toronto London Manchester Sydney Dallas Atlanta "
    "Phoenix Miami Portland Vancouver Dublin Leeds Melbourne"
)
_EN_COURIERS = ("UPS", "FedEx", "DHL", "USPS", "Royal Mail")
_EN_PAYMENTS = ("credit card", "PayPal", "debit card", "Apple Pay", "gift card")
_EN_DAMAGE = (
    "arrived cracked",
    "came with a broken screen",
    "is missing parts",
    "arrived scratched",
    "does not turn on",
    "came in a crushed box",
    "is leaking",
)
_EN_COLORS = ("black", "white", "red", "blue", "grey", "pink", "green", "navy")
_EN_MONTHS = _words("January February March April May June July August September October November December")
_EN_ETAS = ("24 hours", "48 hours", "2 days", "3 days", "2-3 business days", "3 business days")
_EN_GREETINGS = ("", "", "", "Hi! ", "Hello. ", "Hey there. ", "Quick question. ")


def _zh_slots(rng: random.Random) -> dict[str, str]:
    shoes = rng.random() < 0.3
    if shoes:
        i = rng.randrange(36, 45)
        clothes, size, size2 = rng.choice(_ZH_SHOES), str(i), str(i + 1)
    else:
        i = rng.randrange(len(_LETTER_SIZES) - 1)
        clothes, size, size2 = rng.choice(_ZH_CLOTHES), _LETTER_SIZES[i], _LETTER_SIZES[i + 1]
    coupon = rng.choice((5, 10, 15, 20, 30, 50, 100))
    payment, payment2 = rng.sample(_ZH_PAYMENTS, 2)
    return {
        "product": rng.choice(_ZH_PRODUCTS),
        "clothes": clothes,
        "size": size,
        "size2": size2,
        "order": str(rng.randrange(10_000_000, 100_000_000)),
        "city": rng.choice(_ZH_CITIES),
        "road": rng.choice(_ZH_ROADS),
        "num": str(rng.randrange(1, 300)),
        "courier": rng.choice(_ZH_COURIERS),
        "payment": payment,
        "payment2": payment2,
        "pay_error": rng.choice(_ZH_PAY_ERRORS),
        "damage": rng.choice(_ZH_DAMAGE),
        "color": rng.choice(_ZH_COLORS),
        "company": rng.choice(_ZH_CITIES) + rng.choice(_ZH_COMPANIES) + "科技有限公司",
        "eta": rng.choice(_ZH_ETAS),
        "date": f"{rng.randrange(1, 13)}月{rng.randrange(1, 29)}日",
        "days": str(rng.randrange(2, 16)),
        "amount": str(rng.randrange(9, 3000)),
        "diff": str(rng.randrange(5, 201)),
        "comp": str(rng.choice((5, 10, 15, 20, 30))),
        "coupon": str(coupon),
        "threshold": str(rng.choice([t for t in (99, 129, 199, 299, 399, 499) if t > coupon])),
        "greet": rng.choice(_ZH_GREETINGS),
    }


def _en_slots(rng: random.Random) -> dict[str, str]:
    i = rng.randrange(len(_LETTER_SIZES) - 1)
    payment, payment2 = rng.sample(_EN_PAYMENTS, 2)
    return {
        "product": rng.choice(_EN_PRODUCTS),
        "clothes": rng.choice(_EN_CLOTHES),
        "size": _LETTER_SIZES[i],
        "size2": _LETTER_SIZES[i + 1],
        "order": str(rng.randrange(10_000_000, 100_000_000)),
        "city": rng.choice(_EN_CITIES),
        "num": str(rng.randrange(1, 999)),
        "courier": rng.choice(_EN_COURIERS),
        "payment": payment,
        "payment2": payment2,
        "damage": rng.choice(_EN_DAMAGE),
        "color": rng.choice(_EN_COLORS),
        "eta": rng.choice(_EN_ETAS),
        "date": f"{rng.choice(_EN_MONTHS)} {rng.randrange(1, 29)}",
        "days": str(rng.randrange(2, 16)),
        "amount": f"${rng.randrange(9, 500)}",
        "diff": f"${rng.randrange(3, 80)}",
        "comp": f"${rng.choice((5, 10, 15, 20))}",
        "coupon": f"${rng.choice((5, 10, 15, 20, 25))}",
        "threshold": f"${rng.choice((50, 75, 100, 150))}",
        "greet": rng.choice(_EN_GREETINGS),
    }


# --------------------------------------------------------------------------------------------------------------
# Pairwise templates
# --------------------------------------------------------------------------------------------------------------

# Chosen = opener + action (+ closer when it still fits). Openers acknowledge the customer; actions name the
# concrete step with the order number and/or a time frame. Rejected answers never use an opener.
_ZH_APOLOGY = (
    "非常抱歉！",
    "真的很抱歉！",
    "抱歉让您久等了！",
    "理解您的心情，非常抱歉！",
    "抱歉给您添麻烦了！",
    "很抱歉让您着急了！",
    "辛苦您了，实在抱歉！",
    "非常抱歉给您带来不便！",
)
_ZH_SERVICE = (
    "您好，可以的！",
    "没问题，马上为您处理！",
    "好的，感谢您的耐心！",
    "收到，马上为您办理！",
    "当然可以！",
    "您好，很乐意帮您！",
)
_ZH_CLOSERS = ("如有问题随时联系我。", "请您放心。", "祝您生活愉快！", "感谢您的理解！", "有进展会第一时间通知您。")
_ZH_CURT = (
    "不知道。",
    "自己去查。",
    "不清楚，你自己看吧。",
    "这个问题别问我。",
    "没办法，等着吧。",
    "系统就这样，我也没办法。",
    "你问别人吧。",
    "说了多少遍了，自己看订单详情。",
    "我很忙，晚点再说。",
    "这不是我们的问题。",
    "嗯。",
    "不归我管。",
    "不知道，自己去查。",
    "看页面说明，别问了。",
)

_EN_APOLOGY = (
    "I'm so sorry for the trouble!",
    "I'm really sorry about this.",
    "Sorry for the wait, I know it's frustrating.",
    "Thank you for your patience, and I apologize.",
    "I completely understand, and I'm sorry.",
    "I'm sorry this happened to you.",
)
_EN_SERVICE = (
    "Of course, happy to help!",
    "Sure, I can take care of that.",
    "Thanks for reaching out!",
    "Absolutely, I'll handle it now.",
)
_EN_CLOSERS = ("Let me know if you need anything else.", "Thanks for your understanding!", "Have a great day!")
_EN_CURT = (
    "I don't know.",
    "Check it yourself.",
    "Not my problem.",
    "Ask someone else.",
    "Nothing I can do.",
    "Just wait.",
    "Read the FAQ.",
    "No idea, look it up yourself.",
    "That's not our fault.",
    "Whatever.",
)


@dataclass(frozen=True)
class _Topic:
    name: str
    questions: tuple[str, ...]
    actions: tuple[str, ...]
    rejected: tuple[str, ...]
    service: bool = False  # a request rather than a complaint: open politely instead of apologising


_ZH_TOPICS = (
    _Topic(
        "delivery_delay",
        (
            "我的订单{order}已经{days}天了还没收到，{product}什么时候能到？",
            "快递一直停在{city}转运中心，好几天没动了，怎么回事？",
            "买的{product}说好{date}送到，到现在还没消息。",
            "物流信息{days}天没更新了，是不是丢件了？",
            "{courier}的快递怎么这么慢，订单{order}还在路上？",
        ),
        (
            "我查到订单{order}的包裹在{city}中转，预计{eta}内送达，已帮您催{courier}加急派送。",
            "订单{order}因天气原因在{city}滞留，我已登记加急，{eta}内仍未送达将补偿您{comp}元。",
            "已联系{courier}核实订单{order}，包裹没有丢失，预计{eta}内派送，到时会短信提醒您。",
        ),
        (
            "快递的事找{courier}，别找我们。",
            "慢就慢点吧，急也没用。",
            "超过30天没到才能处理，再等等。",
            "物流不归我们管。",
            "丢了就丢了，自己去问快递。",
            "订单{order}显示已签收，我们不处理。",
        ),
    ),
    _Topic(
        "refund_delay",
        (
            "我申请退款{amount}元已经{days}天了，怎么还没到账？",
            "订单{order}退款显示成功，但{payment}里没看到钱。",
            "退货已经寄回去了，退款什么时候能到？",
            "退款一直在审核中，能快点吗？",
        ),
        (
            "我查到订单{order}的退款{amount}元已审核通过，将在{eta}内原路退回您的{payment}。",
            "订单{order}的退货已签收，我已加急处理退款{amount}元，预计{eta}内到账。",
            "已为订单{order}催办退款{amount}元，{eta}内退回{payment}，到账后会短信通知您。",
        ),
        (
            "退款慢很正常，等着吧。",
            "我们不管退款，你去找银行。",
            "退款要60个工作日，别催了。",
            "没收到就是没退，我也没办法。",
            "订单{order}的退款{amount}元要等下个月统一退。",
        ),
    ),
    _Topic(
        "return",
        (
            "{product}收到了不太喜欢，可以退货吗？",
            "订单{order}的{product}买了{days}天了，还能退吗？",
            "我想退掉刚买的{product}，怎么操作？",
            "{product}和描述不一样，我要退货。",
        ),
        (
            "订单{order}支持7天无理由退货，我已为您提交退货申请，快递员{date}上门取件。",
            "我已为订单{order}开通退货，运费由我们承担，商品寄回后{eta}内完成退款。",
            "订单{order}的退货申请已通过，请把{product}寄回，我们收到后{eta}内退款。",
        ),
        (
            "拆封了就不能退。",
            "不能退，自己留着用吧。",
            "退货运费你自己出，还要扣30%手续费。",
            "买之前怎么不看清楚？",
            "特价商品一律不退。",
            "订单{order}超过24小时，不能退了。",
        ),
    ),
    _Topic(
        "damaged",
        (
            "收到的{product}{damage}，怎么办？",
            "刚拆开快递发现{product}{damage}，太让人失望了。",
            "订单{order}的{product}{damage}，能换新的吗？",
        ),
        (
            "请您拍照上传破损处，我会为订单{order}免费补发一件新的{product}，{eta}内发出。",
            "我已为订单{order}登记破损，新的{product}今天就为您补发，旧的不用寄回。",
            "我已为订单{order}申请全额退款{amount}元或免费换新，{eta}内处理完成，您选哪种？",
        ),
        (
            "肯定是你自己弄坏的。",
            "运输难免有磕碰，凑合用吧。",
            "签收了就不管了。",
            "你找快递赔，和我们无关。",
            "订单{order}已签收{days}天，不能补发。",
        ),
    ),
    _Topic(
        "coupon",
        (
            "我的{coupon}元优惠券为什么用不了？",
            "领的满{threshold}减{coupon}券下单时没有抵扣，怎么回事？",
            "优惠券昨天过期了，能补发一张吗？",
            "订单{order}忘了用{coupon}元优惠券，还能补吗？",
        ),
        (
            "这张券需满{threshold}元使用，订单{order}未达到，我为您补发一张{coupon}元无门槛券。",
            "订单{order}漏用了{coupon}元优惠券，我已申请返还{coupon}元，{eta}内退回原支付账户。",
            "已为您补发一张{coupon}元优惠券，有效期到{date}，结算时选择即可使用。",
        ),
        (
            "用不了就别用了。",
            "优惠券的事我不清楚。",
            "过期了就是过期了，不能补。",
            "优惠券只有会员能用，你不是会员。",
            "{coupon}元的券只能在{date}当天用。",
        ),
    ),
    _Topic(
        "invoice",
        (
            "订单{order}怎么开发票？",
            "我需要开公司抬头的增值税发票，可以吗？",
            "发票开错抬头了，能重开吗？",
            "买的{product}能开电子发票吗？",
        ),
        (
            "我已为订单{order}申请电子发票，抬头为{company}，{eta}内发送到您的邮箱。",
            "请提供公司名称和税号，我会为订单{order}开具增值税专用发票，{eta}内寄出。",
            "订单{order}的旧发票已作废，我会按新抬头重新开具，{eta}内发到您邮箱。",
        ),
        (
            "发票自己在网上弄。",
            "我们不开发票。",
            "开发票要加收10%的税点。",
            "开错了不能重开。",
            "订单{order}的发票要等半年后才能开。",
        ),
        service=True,
    ),
    _Topic(
        "address_change",
        (
            "我想把收货地址改成{city}{road}路{num}号，还来得及吗？",
            "订单{order}地址填错了，能帮我改一下吗？",
            "我搬家了，能把{product}改送到{city}吗？",
        ),
        (
            "订单{order}还没发货，我已将地址改为{city}{road}路{num}号，新地址立即生效。",
            "包裹已发出，我已联系{courier}为订单{order}改派到{city}，预计{eta}内送达。",
            "已为订单{order}修改收货地址并备注仓库，{eta}内会短信请您确认。",
        ),
        (
            "下单了就改不了。",
            "你自己联系快递改。",
            "地址填错是你的问题。",
            "改地址要重新下单，原订单作废。",
            "{city}不在配送范围，改不了。",
        ),
        service=True,
    ),
    _Topic(
        "size_exchange",
        (
            "买的{clothes}{size}码偏小，可以换{size2}码吗？",
            "订单{order}的{clothes}尺码不合适，想换成{size2}码。",
            "{clothes}穿着不合身，能换成{size2}码吗？",
        ),
        (
            "订单{order}可以免费换成{size2}码，我已安排{date}上门取件，新的{clothes}{eta}内寄出。",
            "订单{order}已为您改为{size2}码，运费我们承担，新的{clothes}{eta}内发出。",
            "已为订单{order}登记换货，{size2}码有库存，快递员{date}上门取件，请保留吊牌。",
        ),
        (
            "尺码表写得很清楚，是你选错了。",
            "换货太麻烦，不换。",
            "试穿过就不能换了。",
            "自己拿去二手平台卖吧。",
            "{size2}码要另外加{comp}元才能换。",
        ),
    ),
    _Topic(
        "payment",
        (
            "付款时显示{pay_error}，钱扣了但订单没成功。",
            "用{payment}付了{amount}元，订单还显示待付款。",
            "为什么我的{payment}付不了款？",
            "同一个订单被扣了两次钱，怎么办？",
        ),
        (
            "我查到订单{order}的{amount}元已扣款但未成功下单，系统将在{eta}内原路退回。",
            "订单{order}重复扣除的{amount}元已为您申请退回，预计{eta}内到账。",
            "{payment}暂时在维护，建议换用{payment2}支付，订单{order}的优惠为您保留到{date}。",
        ),
        (
            "那是银行的问题，跟我们没关系。",
            "你再付一次试试。",
            "扣两次是正常的，过几个月会退。",
            "付不了就别买了。",
            "{payment}的钱我们查不到，找{payment}去。",
        ),
    ),
    _Topic(
        "not_shipped",
        (
            "下单{days}天了，{product}怎么还没发货？",
            "订单{order}一直显示待发货，到底什么时候发？",
            "说好48小时发货，现在还没动静。",
        ),
        (
            "我已催促仓库优先处理订单{order}，{product}将在{eta}内发出，发货后短信通知您。",
            "订单{order}因补货延迟了，今天内一定发出，并补偿您{comp}元无门槛券。",
            "已为订单{order}加急，{eta}内从{city}仓发出，如仍未发货可直接为您退款。",
        ),
        (
            "仓库忙，等着吧。",
            "什么时候发不知道。",
            "预售商品都要等一个月，别催了。",
            "不想等就退了吧。",
            "订单{order}排队中，催也没用。",
        ),
    ),
    _Topic(
        "price_protection",
        (
            "我买的{product}降价了{diff}元，能退差价吗？",
            "订单{order}刚买完就降价{diff}元，太坑了。",
            "买了{days}天{product}就便宜了{diff}元，能保价吗？",
        ),
        (
            "订单{order}在保价期内，我已为您申请退还差价{diff}元，{eta}内退回原支付账户。",
            "订单{order}符合价保规则，差价{diff}元将在{eta}内返还到您的账户。",
        ),
        (
            "降价是正常的，不退。",
            "谁让你买早了。",
            "保价只针对会员，你不行。",
            "差价退不了，活动价不算。",
            "差价{diff}元太少了，不值得退。",
        ),
    ),
    _Topic(
        "wrong_item",
        (
            "收到的{product}颜色不对，我买的是{color}的。",
            "订单{order}少发了一件{product}。",
            "包裹里的东西不是我买的{product}。",
        ),
        (
            "我已核实订单{order}发错了，正确的{product}今天补发，{eta}内送到，错发的不用寄回。",
            "订单{order}确实是我们的失误，已安排补发{product}，{eta}内送达，并补偿您{comp}元。",
            "我已为订单{order}登记错发，快递员{date}上门取回，正确的{product}同时寄出。",
        ),
        (
            "仓库不会发错，你再找找。",
            "肯定是你家人拿走了。",
            "少发的不补，下次注意。",
            "拍视频证明才算数，否则不处理。",
            "订单{order}的{product}我们查过，没发错。",
        ),
    ),
    _Topic(
        "repair",
        (
            "{product}才用了{days}天就坏了，怎么办？",
            "订单{order}的{product}{damage}，能保修吗？",
        ),
        (
            "订单{order}的{product}在保修期内，我已安排免费换新，快递员{date}上门取件。",
            "我已为订单{order}登记售后，新的{product}{eta}内发出，旧件由快递免费取回。",
        ),
        (
            "人为损坏不保修。",
            "用坏了自己修。",
            "保修要自己寄到厂家，运费自理。",
            "过了七天就不管了。",
            "{product}用了{days}天就不算新品了，不保修。",
        ),
    ),
)

_EN_TOPICS = (
    _Topic(
        "delivery_delay",
        (
            "My order #{order} still hasn't arrived after {days} days. Where is my {product}?",
            "Tracking has been stuck in {city} for days. What is going on?",
            "My {product} was supposed to arrive on {date} and I still have nothing.",
        ),
        (
            (
                "I checked order #{order}: it is at the {courier} hub in {city} and should arrive within {eta}. "
                "I've asked them to expedite it."
            ),
            (
                "Order #{order} was delayed by weather in {city}. I've flagged it as urgent, and if it isn't there "
                "within {eta} you get {comp} back."
            ),
        ),
        (
            "Shipping is {courier}'s job, ask them.",
            "It will come when it comes.",
            "We only help after 60 days, wait.",
            "Tracking is not our problem.",
            "Order #{order} shows delivered, so we are done.",
        ),
    ),
    _Topic(
        "refund_delay",
        (
            "I asked for a refund of {amount} {days} days ago and it still hasn't arrived.",
            "Order #{order} says refunded but nothing is on my {payment}.",
        ),
        (
            (
                "I checked order #{order}: the refund of {amount} was approved and will reach your {payment} within "
                "{eta}."
            ),
            (
                "Your return for order #{order} was received, so I've pushed the {amount} refund through; expect it "
                "within {eta}."
            ),
        ),
        (
            "Refunds are slow, deal with it.",
            "Ask your bank, not us.",
            "Refunds take 90 days, stop asking.",
            "The {amount} refund for order #{order} goes out next quarter.",
        ),
    ),
    _Topic(
        "return",
        (
            "I don't like the {product} I received. Can I return it?",
            "How do I return the {product} from order #{order}?",
        ),
        (
            (
                "Order #{order} qualifies for free returns. I've created the return label and a courier will pick it "
                "up on {date}."
            ),
            "I've opened a return for order #{order}; once the {product} is back we refund you within {eta}.",
        ),
        (
            "Opened items can't be returned.",
            "No returns, keep it.",
            "You pay shipping plus a 30% fee.",
            "Order #{order} is past the 24 hour return window.",
        ),
    ),
    _Topic(
        "damaged",
        (
            "The {product} from order #{order} {damage}.",
            "My {product} {damage}. What can you do?",
        ),
        (
            (
                "Please send a photo of the damage, and I'll ship a free replacement {product} for order #{order} "
                "within {eta}."
            ),
            ("I've logged the damage on order #{order} and sent a new {product} today; no need to return the old one."),
        ),
        ("You probably broke it yourself.", "Some damage is normal, just use it.", "Complain to the courier."),
    ),
    _Topic(
        "coupon",
        (
            "Why won't my {coupon} coupon work?",
            "I forgot to use my {coupon} coupon on order #{order}. Can you still apply it?",
        ),
        (
            (
                "That coupon needs a {threshold} minimum, so I've added a {coupon} no-minimum coupon to your account "
                "for order #{order}."
            ),
            "I've refunded {coupon} for the missed coupon on order #{order}; it will reach you within {eta}.",
        ),
        (
            "Then don't use it.",
            "Expired is expired.",
            "Coupons are members only.",
            "Coupons never apply after checkout.",
        ),
    ),
    _Topic(
        "address_change",
        (
            "Can I change the delivery address of order #{order} to {num} Main Street, {city}?",
            "I typed the wrong address for my {product}. Can you fix it?",
        ),
        (
            (
                "Order #{order} has not shipped yet, so I've updated the address to {num} Main Street, {city}; the "
                "change is live now."
            ),
            "I've asked {courier} to reroute order #{order} to your new address; it should arrive within {eta}.",
        ),
        ("You can't change it after ordering.", "Call the courier yourself.", "Your typo, your problem."),
        service=True,
    ),
    _Topic(
        "size_exchange",
        (
            "The {clothes} I bought in {size} is too small. Can I swap it for {size2}?",
            "Can I exchange the {clothes} from order #{order} for a size {size2}?",
        ),
        (
            (
                "Order #{order} can be exchanged for size {size2} for free. A courier will collect the {clothes} "
                "on {date}, and the new one ships within {eta}."
            ),
            (
                "I've switched order #{order} to size {size2}, shipping is on us, and the new {clothes} ships within "
                "{eta}."
            ),
        ),
        (
            "The size chart was clear, you picked wrong.",
            "Exchanges are too much hassle.",
            "Worn items can't be swapped.",
        ),
    ),
    _Topic(
        "payment",
        (
            "I paid {amount} with my {payment} but the order still says unpaid.",
            "I was charged twice for order #{order}.",
        ),
        (
            (
                "I see the {amount} charge on order #{order} did not complete, so it will be returned to your "
                "{payment} within {eta}."
            ),
            "I've reversed the duplicate {amount} charge on order #{order}; you should see it back within {eta}.",
        ),
        ("That's your bank's problem.", "Just pay again.", "Double charges fix themselves in a few months."),
    ),
)


def _compose_chosen(rng: random.Random, topic: _Topic, slots: dict[str, str], english: bool) -> str:
    openers = (
        (_EN_SERVICE if topic.service else _EN_APOLOGY) if english else (_ZH_SERVICE if topic.service else _ZH_APOLOGY)
    )
    sep = " " if english else ""
    text = rng.choice(openers) + sep + rng.choice(topic.actions).format_map(slots)
    closer = rng.choice(_EN_CLOSERS if english else _ZH_CLOSERS)
    # Keep answers short for max_seq_len 128-256: add a closer only when it still fits.
    if rng.random() < 0.35 and (
        len(text.split()) + len(closer.split()) <= 45 if english else len(text) + len(closer) <= 60
    ):
        text += sep + closer
    return text


def _compose_rejected(rng: random.Random, topic: _Topic, slots: dict[str, str], english: bool) -> str:
    generic = _EN_CURT if english else _ZH_CURT
    pool = topic.rejected if rng.random() < 0.6 else generic
    return rng.choice(pool).format_map(slots)


def _pairwise_row(rng: random.Random, english: bool) -> dict[str, str]:
    topic = rng.choice(_EN_TOPICS if english else _ZH_TOPICS)
    slots = _en_slots(rng) if english else _zh_slots(rng)
    question = slots["greet"] + rng.choice(topic.questions).format_map(slots)
    chosen = " " + _compose_chosen(rng, topic, slots, english)
    rejected = " " + _compose_rejected(rng, topic, slots, english)
    return {"prompt": format_prompt(question), "response": chosen, "chosen": chosen, "rejected": rejected}


def _balanced_flags(rng: random.Random, n: int, k: int) -> list[bool]:
    """``k`` True among ``n``, shuffled: a fraction drawn row by row would wander by a few percent at small n."""
    flags = [True] * k + [False] * (n - k)
    rng.shuffle(flags)
    return flags


def _pairwise_rows(rng: random.Random, n: int, english_ratio: float) -> list[dict[str, str]]:
    rows: list[dict[str, str]] = []
    seen: set[str] = set()
    for english in _balanced_flags(rng, n, round(n * english_ratio)):
        for _ in range(100):  # unique prompts, so a train/eval split never shares a question
            row = _pairwise_row(rng, english)
            if row["prompt"] not in seen and row["chosen"] != row["rejected"]:
                break
        else:
            raise RuntimeError("could not draw a new unique prompt; the templates are too few for n")
        seen.add(row["prompt"])
        rows.append(row)
    return rows


def generate_pairwise(
    n: int = DEFAULT_PAIRWISE_ROWS, seed: int = 0, english_ratio: float = 0.2
) -> list[dict[str, str]]:
    """Demo preference rows in rm-static format: ``{"prompt", "response", "chosen", "rejected"}``.

    ``response == chosen``; both answers start with a space; prompts are unique; chosen != rejected.
    Exactly ``round(n * english_ratio)`` rows are English, the rest Chinese.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return _pairwise_rows(_stream("pairwise", seed), n, english_ratio)


# --------------------------------------------------------------------------------------------------------------
# Prompt-only rows with checkable answers (GRPO)
# --------------------------------------------------------------------------------------------------------------

_ZH_FORMAT_HINT = "请在<think></think>中写出计算过程，并在<answer></answer>中只写最终数字。"
_EN_FORMAT_HINT = "Show your work in <think></think> and put only the final number in <answer></answer>."


def _arith_problem(rng: random.Random, english: bool) -> tuple[str, int, str]:
    """One word problem: (question, integer answer, worked reasoning for the think block)."""
    kind = rng.randrange(6)
    product = rng.choice(_EN_PRODUCTS if english else _ZH_PRODUCTS)
    if kind == 0:  # quantity x unit price
        q, p = rng.randrange(2, 10), rng.randrange(5, 200)
        ans = q * p
        text = (
            f"I bought {q} units of the {product} at ${p} each. How many dollars do I pay in total?"
            if english
            else f"我买了{q}件{product}，每件{p}元，一共要付多少元？"
        )
        work = f"{q}*{p}={ans}"
    elif kind == 1:  # fixed coupon
        p, c = rng.randrange(50, 1000), rng.choice((5, 10, 20, 30, 50))
        ans = p - c
        text = (
            f"My order costs ${p} and I use a ${c} coupon. How many dollars do I pay?"
            if english
            else f"商品总价{p}元，用了一张{c}元优惠券，实付多少元？"
        )
        work = f"{p}-{c}={ans}"
    elif kind == 2:  # spend-t-save-d, sometimes below the threshold
        t, d = rng.choice((99, 199, 299)), rng.choice((10, 20, 30, 50))
        p = rng.randrange(t - 60, t) if rng.random() < 0.3 else rng.randrange(t, t + 300)
        ans = p - d if p >= t else p
        text = (
            f"The shop gives ${d} off orders of ${t} or more. My cart is ${p}. How many dollars do I pay?"
            if english
            else f"满{t}减{d}，我买了{p}元的商品，实付多少元？"
        )
        # No "<" in the reasoning: it would look like the start of a tag.
        if english:
            work = f"{p} reaches {t}, {p}-{d}={ans}" if p >= t else f"{p} is below {t}, no discount, {ans}"
        else:
            work = f"{p}满{t}，{p}-{d}={ans}" if p >= t else f"{p}未满{t}，不减，{ans}"
    elif kind == 3:  # partial refund
        q, unit = rng.randrange(2, 7), rng.randrange(10, 200)
        r = rng.randrange(1, q)
        ans = r * unit
        text = (
            f"I bought {q} units of the {product} at ${unit} each and returned {r}. How many dollars is my refund?"
            if english
            else f"我买了{q}件{product}，每件{unit}元，退回{r}件，应退款多少元？"
        )
        work = f"{r}*{unit}={ans}"
    elif kind == 4:  # percentage discount; the price is a multiple of 10 so the answer is an integer
        p, k = rng.randrange(5, 100) * 10, rng.randrange(5, 10)
        ans = p * k // 10
        text = (
            f"A {product} costs ${p} and is {100 - 10 * k}% off. How many dollars do I pay?"
            if english
            else f"{product}原价{p}元，打{k}折后多少元？"
        )
        work = f"{p}*{k}/10={ans}"
    else:  # price + shipping - coupon
        p, s, c = rng.randrange(20, 500), rng.choice((6, 8, 10, 12, 15)), rng.choice((5, 10, 20))
        ans = p + s - c
        text = (
            f"An item costs ${p}, shipping is ${s}, and I have a ${c} coupon. How many dollars do I pay?"
            if english
            else f"商品{p}元，运费{s}元，再用{c}元优惠券，一共付多少元？"
        )
        work = f"{p}+{s}-{c}={ans}"
    return text, ans, work


def format_completion(reasoning: str, answer: str) -> str:
    """The completion format rule rewards expect: ``<think>...</think><answer>...</answer>``."""
    return f"{THINK_OPEN}{reasoning}{THINK_CLOSE}{ANSWER_OPEN}{answer}{ANSWER_CLOSE}"


def generate_prompts(
    n: int = DEFAULT_PROMPT_ROWS, seed: int = 0, english_ratio: float = 0.2, with_solution: bool = False
) -> list[dict[str, str]]:
    """Prompt-only rows ``{"prompt", "answer"}`` with an integer answer as a string, for GRPO rule rewards.

    The prompt asks for ``<think>...</think><answer>N</answer>``. ``with_solution`` adds ``"solution"``, a
    correct completion in that format (e.g. to warm up the format with SFT); off by default so the rows stay
    plain prompt-only rows.
    """
    rng = _stream("prompts", seed)
    rows = []
    for english in _balanced_flags(rng, n, round(n * english_ratio)):
        text, ans, work = _arith_problem(rng, english)
        hint = _EN_FORMAT_HINT if english else _ZH_FORMAT_HINT
        row = {"prompt": format_prompt(text + (" " if english else "") + hint), "answer": str(ans)}
        if with_solution:
            row["solution"] = " " + format_completion(work, str(ans))
        rows.append(row)
    return rows


def _sum_problem(rng: random.Random, english: bool, max_addend: int) -> tuple[str, int, str]:
    """One counting question: ``a`` units of one product plus ``b`` of another, both in 1..max_addend."""
    a, b = rng.randint(1, max_addend), rng.randint(1, max_addend)
    first, second = rng.sample(_EN_PRODUCTS if english else _ZH_PRODUCTS, 2)
    # English in a cart's notation ("keyboard x2"), which needs no plural of the product names.
    text = (f"I ordered {first} x{a} and {second} x{b}. How many items is that?" if english
            else f"我买了{a}件{first}和{b}件{second}，一共几件？")
    return text, a + b, f"{a}+{b}={a + b}"


def generate_sum_prompts(
    n: int = DEFAULT_PROMPT_ROWS, seed: int = 0, english_ratio: float = 0.2, with_solution: bool = False,
    max_addend: int = 5, exclude: frozenset[str] = frozenset(),
) -> list[dict[str, str]]:
    """Prompt-only rows ``{"prompt", "answer"}`` of small sums ("I ordered X x3 and Y x5. How many items is
    that?", both addends in ``1..max_addend``), in the format of ``generate_prompts``; ``with_solution`` adds
    ``" <think>3+5=8</think><answer>8</answer>"``. Prompts are unique and none is in ``exclude`` (the prompts of
    another file, so that held-out rows are never trained on).

    The GRPO demo's task. The word problems of ``generate_prompts`` are beyond a 1.4M-parameter model (it learns
    their format, never their arithmetic). With addends up to 5 (25 sums), one SFT epoch leaves it copying the
    addends and adding them when greedy (mostly right) but rarely when sampling, and GRPO's reward for the right
    answer makes the samples right more often: ``accuracy`` itself moves, not only ``format``. (Up to 9, 81
    sums: two SFT epochs leave most samples wrong, and 100 GRPO steps added little to that.)
    """
    rng = _stream("sums", seed)
    rows: list[dict[str, str]] = []
    seen = set(exclude)
    for english in _balanced_flags(rng, n, round(n * english_ratio)):
        for _ in range(100):
            text, ans, work = _sum_problem(rng, english, max_addend)
            hint = _EN_FORMAT_HINT if english else _ZH_FORMAT_HINT
            prompt = format_prompt(text + (" " if english else "") + hint)
            if prompt not in seen:
                break
        else:
            raise RuntimeError("could not draw a new unique prompt; the templates are too few for n")
        seen.add(prompt)
        row = {"prompt": prompt, "answer": str(ans)}
        if with_solution:
            row["solution"] = " " + format_completion(work, str(ans))
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------------------------
# Products with a calculator (the tools demo)
# --------------------------------------------------------------------------------------------------------------

_ZH_TOOL_HINT = "请在<answer></answer>中只写最终数字。"
_EN_TOOL_HINT = "Put only the final number in <answer></answer>."


def _product_problem(rng: random.Random, english: bool) -> tuple[str, int, str]:
    """One order's total: ``q`` units (2..19) at ``p`` each (11..99), a product no 1.4M-parameter model computes
    in its head: (question, answer, the calculator expression)."""
    q, p = rng.randint(2, 19), rng.randint(11, 99)
    product = rng.choice(_EN_PRODUCTS if english else _ZH_PRODUCTS)
    text = (f"I ordered {product} x{q} at ${p} each. How many dollars is that?" if english
            else f"我买了{q}件{product}，每件{p}元，一共多少元？")
    return text, q * p, f"{q}*{p}"


def generate_tool_prompts(n: int = DEFAULT_PROMPT_ROWS, seed: int = 0, english_ratio: float = 0.2,
                          with_trace: bool = False, exclude: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """Prompt-only rows ``{"prompt", "answer"}`` of order totals (``q`` units at ``p`` each), the tools demo's
    task: unique prompts, none in ``exclude``. ``with_trace`` gives SFT rows instead: ``{"messages": [...]}``, the
    user's question, the assistant's call ``<tool_call>calculator(q*p)</tool_call>``, the tool's result and the
    assistant's ``<answer>N</answer>`` (docs/tools.md, SFT on tool traces)."""
    rng = _stream("tools", seed)
    rows: list[dict[str, Any]] = []
    seen = set(exclude)
    for english in _balanced_flags(rng, n, round(n * english_ratio)):
        for _ in range(100):
            text, ans, expr = _product_problem(rng, english)
            question = text + (" " if english else "") + (_EN_TOOL_HINT if english else _ZH_TOOL_HINT)
            prompt = format_prompt(question)
            if prompt not in seen:
                break
        else:
            raise RuntimeError("could not draw a new unique prompt; the templates are too few for n")
        seen.add(prompt)
        if with_trace:
            rows.append({"messages": [
                {"role": "user", "content": question},
                {"role": "assistant", "content": f"<tool_call>calculator({expr})</tool_call>"},
                {"role": "tool", "name": "calculator", "content": str(ans)},
                {"role": "assistant", "content": f"{ANSWER_OPEN}{ans}{ANSWER_CLOSE}"}]})
        else:
            rows.append({"prompt": prompt, "answer": str(ans)})
    return rows


# --------------------------------------------------------------------------------------------------------------
# RM-R1 judge rows
# --------------------------------------------------------------------------------------------------------------

def generate_judge_pairs(
    n: int = DEFAULT_JUDGE_ROWS, seed: int = 0, english_ratio: float = 0.2, with_rubric: bool = True
) -> list[dict[str, object]]:
    """RM-R1 judge rows ``{"context_messages": [...], "winner": "model_a" | "model_b"}``.

    Built from pairwise rows of their own stream; exactly ``n // 2`` rows have the good answer in A. With
    ``with_rubric`` the first message is a system rubric in the row's language.
    """
    rng = _stream("judge", seed)
    pairs = _pairwise_rows(rng, n, english_ratio)
    rows: list[dict[str, object]] = []
    for pair, a_wins in zip(pairs, _balanced_flags(rng, n, n // 2), strict=True):
        question = prompt_question(pair["prompt"])
        english = is_english(question)
        good, bad = pair["chosen"].strip(), pair["rejected"].strip()
        answer_a, answer_b = (good, bad) if a_wins else (bad, good)
        messages = []
        if with_rubric:
            messages.append({"role": "system", "content": EN_RUBRIC if english else ZH_RUBRIC})
        messages.append({"role": "user", "content": judge_user_message(question, answer_a, answer_b, english)})
        rows.append({"context_messages": messages, "winner": "model_a" if a_wins else "model_b"})
    return rows


# The cold-start judge completion: a fixed analysis in the row's language, then the verdict. RM-R1 distils
# question-specific reasoning traces from stronger models before GRPO; the demo has no teacher, so its "trace" is
# one sentence restating the rubric, followed by the true winner's verdict (or, for a format-only cold start, a
# random one).
_ZH_JUDGE_THINK = "比较两个回答是否体谅顾客、给出具体的处理步骤，并说明订单号或处理时限。"
_EN_JUDGE_THINK = "Compare empathy, a concrete next step, and the order number or a time frame."


def judge_completion(verdict: str, english: bool) -> str:
    """A judge completion in RM-R1's format: ``<think>...</think>\n<answer>[[A]]</answer>`` (or ``[[B]]``)."""
    if verdict not in ("A", "B"):
        raise ValueError(f"verdict must be 'A' or 'B', got {verdict!r}")
    think = _EN_JUDGE_THINK if english else _ZH_JUDGE_THINK
    return f"{THINK_OPEN}{think}{THINK_CLOSE}\n{ANSWER_OPEN}[[{verdict}]]{ANSWER_CLOSE}"


def generate_judge_cold_start(
    n: int = DEFAULT_JUDGE_ROWS, seed: int = 1, verdicts: str = "random", english_ratio: float = 0.2
) -> list[dict[str, object]]:
    """Judge rows (as ``generate_judge_pairs``) with a ``response``: the completion SFT teaches before GRPO.

    ``verdicts="random"``: the verdict is drawn independently of the winner, half A and half B, so SFT teaches
    the format and no judging (the SFT judge is at chance and every gain after it is GRPO's);
    ``verdicts="winner"``: the verdict is the true winner (a distilled, correct cold start).
    """
    if verdicts not in ("random", "winner"):
        raise ValueError(f"verdicts must be 'random' or 'winner', got {verdicts!r}")
    rows = generate_judge_pairs(n, seed, english_ratio)
    draws = _balanced_flags(_stream("judge_cold_start", seed), n, n // 2)
    out: list[dict[str, object]] = []
    for row, a in zip(rows, draws, strict=True):
        if verdicts == "winner":
            a = row["winner"] == "model_a"
        user = row["context_messages"][-1]["content"]  # type: ignore[index]
        english = is_english(user.split("[User Question]")[-1])  # type: ignore[union-attr]
        out.append({**row, "response": judge_completion("A" if a else "B", english)})
    return out


# --------------------------------------------------------------------------------------------------------------
# Files and tokenizer text
# --------------------------------------------------------------------------------------------------------------


def write_demo_files(
    out_dir: str | Path,
    seed: int = 0,
    n_pairwise: int = DEFAULT_PAIRWISE_ROWS,
    n_prompts: int = DEFAULT_PROMPT_ROWS,
    n_judge: int = DEFAULT_JUDGE_ROWS,
) -> dict[str, Path]:
    """Write ``pairwise.jsonl``, ``prompts.jsonl`` and ``judge.jsonl`` into ``out_dir``.

    Returns ``{"pairwise": path, "prompts": path, "judge": path}``. Same arguments, byte-identical files.
    """
    out = Path(out_dir)
    return {
        "pairwise": write_jsonl(generate_pairwise(n_pairwise, seed), out / "pairwise.jsonl"),
        "prompts": write_jsonl(generate_prompts(n_prompts, seed), out / "prompts.jsonl"),
        "judge": write_jsonl(generate_judge_pairs(n_judge, seed), out / "judge.jsonl"),
    }


def tokenizer_training_text(seed: int = 0) -> Iterator[str]:
    """The texts the tiny tokenizer is trained on: every sequence the demo stages will tokenize.

    Prompt + chosen and prompt + rejected (stages 1-2), prompts with a worked completion (GRPO), and judge
    messages (RM-R1), so the frequent pieces of all of them get their own tokens.
    """
    for row in generate_pairwise(seed=seed):
        yield row["prompt"] + row["chosen"]
        yield row["prompt"] + row["rejected"]
    for row in generate_prompts(seed=seed, with_solution=True):
        yield row["prompt"] + row["solution"]
    for judge in generate_judge_pairs(seed=seed):
        for message in judge["context_messages"]:  # type: ignore[union-attr]
            yield message["content"]  # type: ignore[index]
